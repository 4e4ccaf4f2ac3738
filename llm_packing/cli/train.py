"""Training entry point: a flat YAML recipe in, a fine-tuned model out, documents packed without contamination.

    python -m llm_packing.train --config recipes/tiny-cpu.yaml
    accelerate launch -m llm_packing.train --config recipes/tiny-cpu.yaml
    llm-packing train --config recipes/tiny-cpu.yaml --max_steps 5

Each recipe key goes to the dataclass that has a field of that name (`train_arguments`): TRL's `SFTConfig` (training)
and `ModelConfig` (model, LoRA), our [`~llm_packing.cli.train_arguments.ScriptArguments`] (data, tiny model) and
[`~llm_packing.cli.arguments.PackingArguments`]. Flags on the command line override the recipe. Flow: tokenizer and
model, documents tokenized with the chat template (labels -100 outside assistant turns with `assistant_only_loss:
true`), `pack_dataset`, then [`~llm_packing.trainers.sft.PackedSFTTrainer`] (TRL's `SFTTrainer` for packed rows:
`DataCollatorWithPacking`, `configure_packing` + `verify_packing`), train, save. Rank 0 tells what happens; `--help`
lists the packing keys.
"""

import contextlib
import logging
import os

import torch
from transformers import TrainerCallback, set_seed
from trl import get_peft_config

from ..batches.collator import DataCollatorWithPacking
from ..data.pack import pack_dataset
from ..errors import UnsupportedSetupError
from ..hook.configure import packing_configured
from ..trainers.sft import PackedSFTTrainer
from .documents import load_documents, load_tokenizer, tokenize_documents
from .sample_reply import sample_reply
from .startup import load_model, setup_logging
from .train_arguments import parse_args


logger = logging.getLogger("llm_packing.train")  # the name users know from `python -m llm_packing.train`


def main(argv: list[str] | None = None):
    """Parse the recipe and flags in `argv` (default `sys.argv[1:]`) and train; returns the `TrainOutput`."""
    arguments = parse_args(argv)
    _refuse_sequence_parallel_elsewhere(arguments[0], arguments[3])
    if arguments[0].trainer != "sft":
        from .train_preference import train_preference

        return train_preference(*arguments)
    return train(*arguments)


def _refuse_sequence_parallel_elsewhere(script_args, packing_args) -> None:
    """Only the text SFT trainer cuts rows across processes; elsewhere the key would be ignored."""
    size = packing_args.sequence_parallel_size
    other = (f"`trainer: {script_args.trainer}`" if script_args.trainer != "sft"
             else "image-text training (`processor_name_or_path`)" if script_args.processor_name_or_path else None)
    if size > 1 and other:
        raise UnsupportedSetupError(
            f"`sequence_parallel_size: {size}` is supported by text SFT (`trainer: sft`) only, not {other}. Set "
            "`sequence_parallel_size: 1`."
        )


def pack_documents(documents, training_args, packing_args, max_docs_per_bin):
    """The packed rows and their stats, by `pack_dataset` or, with `packing_engine: ray`, `pack_dataset_on_ray`
    (on global rank 0; the other ranks load its shards)."""
    options = {"strategy": packing_args.packing_strategy, "seed": packing_args.packing_seed,
               "overflow": packing_args.overflow, "max_docs_per_bin": max_docs_per_bin}
    if packing_args.packing_engine == "local":
        return pack_dataset(documents, training_args.max_length, num_proc=training_args.dataset_num_proc,
                            return_stats=True, **options)
    from ..data.on_ray import load_packed, pack_dataset_on_ray

    packed_dir = packing_args.packed_dir or os.path.join(training_args.output_dir, "packed_rows")
    if training_args.process_index != 0:
        return load_packed(packed_dir, training_args.max_length)
    return pack_dataset_on_ray(documents, training_args.max_length, packed_dir, address=packing_args.ray_address,
                               return_stats=True, **options)


def train(script_args, training_args, model_args, packing_args):
    """Train as configured by the four dataclasses of [`parse_args`]; returns the `TrainOutput`."""
    if script_args.processor_name_or_path is not None:
        from .train_image_text import train_image_text

        return train_image_text(script_args, training_args, model_args, packing_args)
    setup_logging(training_args)
    set_seed(training_args.seed)  # a randomly initialised model is the same on every rank and every run
    tokenizer = load_tokenizer(script_args.tokenizer_name_or_path or model_args.model_name_or_path,
                               revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                               chat_template_path=training_args.chat_template_path)
    model = load_model(script_args, model_args, training_args, tokenizer)
    # With Ray, one process (global rank 0) packs into the shared `packed_dir`, and the others load its shards.
    with training_args.main_process_first(local=packing_args.packing_engine != "ray", desc="tokenizing and packing"):
        documents = load_documents(script_args.dataset_name, config=script_args.dataset_config,
                                   split=script_args.dataset_train_split, max_samples=script_args.max_samples)
        documents = tokenize_documents(documents, tokenizer, messages_field=script_args.dataset_messages_field,
                                       text_field=training_args.dataset_text_field,
                                       assistant_only_loss=training_args.assistant_only_loss,
                                       num_proc=training_args.dataset_num_proc)
        # Unpacked training is the same pipeline with one document per row, so both see the same documents.
        max_docs_per_bin = packing_args.max_docs_per_bin if packing_args.block_diag_attn else 1
        rows, stats = pack_documents(documents, training_args, packing_args, max_docs_per_bin)
    layout = ("padding-free" if packing_args.padding_free
              else "indexed mask" if packing_args.block_diag_attn else "unpacked")
    # pack_dataset has logged the stats (on rank 0 only, see `_setup_logging`).
    logger.info("attention backend %r; layout %s; %d documents in %d rows", model.config._attn_implementation, layout,
                len(documents), len(rows))
    _warn_if_mostly_split(stats, len(documents), training_args.max_length)
    # Unhooked on exit, unless the caller had configured packing already.
    hook = (packing_configured(model, attention_route=packing_args.attention_route) if packing_args.block_diag_attn
            else contextlib.nullcontext())
    with hook:
        collator = DataCollatorWithPacking(pad_token_id=tokenizer.pad_token_id, max_length=training_args.max_length,
                                           pad_to_multiple_of=training_args.pad_to_multiple_of,
                                           padding_free=packing_args.padding_free)
        # `assistant_only_loss` was applied when tokenizing; TRL would check for raw conversations, which we replaced.
        training_args.assistant_only_loss = False
        counter = _BatchCounter()
        trainer = PackedSFTTrainer(model=model, args=training_args, train_dataset=rows, data_collator=collator,
                                   processing_class=tokenizer, peft_config=get_peft_config(model_args),
                                   callbacks=[counter], verify_packing=packing_args.verify_packing,
                                   sequence_parallel_size=packing_args.sequence_parallel_size)
        _log_sample_reply(script_args.sample_prompt, trainer.model, tokenizer, "before training")
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        _log_sample_reply(script_args.sample_prompt, trainer.model, tokenizer, "after training")
        batches = trainer.accelerator.gather(torch.tensor([counter.batches], device=trainer.args.device)).tolist()
        trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        logger.info("trained %d optimizer steps on %s batches (per rank); %s; mean loss over the run %.4f",
                    trainer.state.global_step, batches, _last_logged_loss(trainer.state.log_history),
                    result.training_loss)
        saved = ", ".join(sorted(os.listdir(training_args.output_dir)))
        logger.info("model saved to %s (%s): the final model is always saved there; `save_strategy` only sets "
                    "checkpoints during training", os.path.abspath(training_args.output_dir), saved)
    return result


def _last_logged_loss(log_history: list[dict]) -> str:
    logged = [entry for entry in log_history if "loss" in entry]
    if not logged:
        return "no loss logged (`logging_steps` is more than the steps run)"
    return f"last logged loss {logged[-1]['loss']:.4f} (step {logged[-1]['step']})"


def _warn_if_mostly_split(stats, num_documents: int, max_length: int) -> None:
    documents = num_documents - stats.empty_sequences
    if stats.split_sequences * 2 > documents:
        logger.warning(
            "%d of %d documents are longer than max_length %d and were split into pieces trained as separate "
            "documents, each without the context before it. Raise `--max_length` (`llm-packing stats --max_length N` "
            "shows how documents fit), or set `--overflow drop` or `truncate`.", stats.split_sequences, documents,
            max_length,
        )


def _log_sample_reply(prompt, model, tokenizer, when) -> None:
    if prompt is not None:
        logger.info("%s, reply to %r: %r", when, prompt, sample_reply(model, tokenizer, prompt))


class _BatchCounter(TrainerCallback):
    """Counts the micro-batches this rank trained on (one per substep and one per optimizer step)."""

    def __init__(self):
        self.batches = 0

    def on_substep_end(self, args, state, control, **kwargs):
        self.batches += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.batches += 1


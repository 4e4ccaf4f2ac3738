"""The image-text flow of `llm_packing.train`: a recipe with `processor_name_or_path` trains TRL's vision format.

    python -m llm_packing.train --config recipes/tiny-cpu-vlm.yaml

Processor and model (a checkpoint, or a tiny one built from `model_config` with the processor's token ids and
vocabulary), the conversations (`messages` + `images`, and `videos` beside or instead of them: a hub dataset, a local
file or folder, or `"photos"` / `"clips"`, the built-in ones), `pack_dataset(..., processor=...)` by their true token
counts with images and videos expanded (planned from the files' headers, nothing decoded; with `assistant_only_loss`
by the template the trainer collates with: TRL's training template where the processor's has no `{% generation %}`
markers), then [`~llm_packing.trainers.sft.PackedSFTTrainer`] with the processor: each row's documents are
processed as TRL's vision collator processes them (videos decoded with PyAV), and the hook keeps them apart.
"""

import contextlib
import logging
import os

import pyarrow as pa
import pyarrow.compute as pc
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, set_seed
from trl import get_peft_config

from ..data.pack import pack_dataset
from ..data.pack_image_text import VIDEO_COLUMN, image_column, is_image_text
from ..demo.clips import DEMO_VIDEO_PROCESSOR_NAME, load_demo_video_processor
from ..demo.photos import DEMO_PROCESSOR_NAME, load_demo_processor
from ..errors import PackingValueError
from ..hook.configure import packing_configured
from ..trainers.image_text import training_chat_template
from ..trainers.sft import PackedSFTTrainer
from .documents import load_documents
from .startup import setup_logging


logger = logging.getLogger("llm_packing.train")

_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def train_image_text(script_args, training_args, model_args, packing_args):
    """Train an image-text model as the four dataclasses of `parse_args` configure it; returns the `TrainOutput`."""
    setup_logging(training_args)
    set_seed(training_args.seed)
    if script_args.sample_prompt is not None:
        raise PackingValueError(
            "`sample_prompt` logs a text model's reply; it is not supported with `processor_name_or_path`. Remove it."
        )
    processor = load_processor(script_args.processor_name_or_path, revision=model_args.model_revision,
                               trust_remote_code=training_args.trust_remote_code)
    model = load_image_text_model(script_args, model_args, training_args, processor)
    with training_args.main_process_first(desc="planning and packing"):
        documents = load_documents(script_args.dataset_name, config=script_args.dataset_config,
                                   split=script_args.dataset_train_split, max_samples=script_args.max_samples)
        if not is_image_text(documents):
            raise PackingValueError(
                f"`dataset_name` {script_args.dataset_name!r} has columns {documents.column_names}, no `images` or "
                "`image`: with `processor_name_or_path` the data is TRL's vision format (`messages` + `images`). "
                "Give an image-text dataset, or drop `processor_name_or_path` to train text."
            )
        max_docs_per_bin = packing_args.max_docs_per_bin if packing_args.block_diag_attn else 1
        rows, stats = pack_dataset(documents, training_args.max_length, strategy=packing_args.packing_strategy,
                                   seed=packing_args.packing_seed, overflow=packing_args.overflow,
                                   max_docs_per_bin=max_docs_per_bin, num_proc=training_args.dataset_num_proc,
                                   return_stats=True, processor=processor,
                                   chat_template=training_chat_template(processor, training_args.assistant_only_loss))
    media = f"{_count(documents, image_column(documents))} images"
    if VIDEO_COLUMN in documents.column_names:
        media += f", {_count(documents, VIDEO_COLUMN)} videos"
    logger.info("attention backend %r; layout %s; %d conversations (%s) in %d rows",
                model.config._attn_implementation, "indexed mask" if packing_args.block_diag_attn else "unpacked",
                len(documents), media, len(rows))
    hook = (packing_configured(model, attention_route=packing_args.attention_route) if packing_args.block_diag_attn
            else contextlib.nullcontext())
    with hook:
        trainer = PackedSFTTrainer(model=model, args=training_args, train_dataset=rows, processing_class=processor,
                                   peft_config=get_peft_config(model_args), verify_packing=packing_args.verify_packing)
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        last = f"last logged loss {logged[-1]['loss']:.4f} (step {logged[-1]['step']})" if logged else "no loss logged"
        logger.info("trained %d optimizer steps; %s; mean loss over the run %.4f; model saved to %s",
                    trainer.state.global_step, last, result.training_loss, os.path.abspath(training_args.output_dir))
    return result


def load_processor(name: str, *, revision: str | None = None, trust_remote_code: bool = False):
    """The processor `name` (a hub id or local path), or the built-in tiny Qwen2.5-VL one for `"demo-qwen2.5-vl"`
    (with its video processor: `"demo-qwen2.5-vl-video"`)."""
    if name == DEMO_PROCESSOR_NAME:
        return load_demo_processor()
    if name == DEMO_VIDEO_PROCESSOR_NAME:
        return load_demo_video_processor()
    return AutoProcessor.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)


def load_image_text_model(script_args, model_args, training_args, processor):
    """`model_name_or_path` loaded, or a randomly initialised image-text model built from `model_config` with the
    processor's vocabulary and token ids."""
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    if script_args.model_config is None:
        model = AutoModelForImageTextToText.from_pretrained(
            model_args.model_name_or_path, revision=model_args.model_revision, dtype=dtype,
            trust_remote_code=training_args.trust_remote_code, attn_implementation=model_args.attn_implementation,
            **(training_args.model_init_kwargs or {}))
    else:
        block = dict(script_args.model_config)
        model_type = block.pop("model_type", None)
        if model_type is None:
            raise PackingValueError(
                "`model_config` needs a `model_type` for an image-text model (e.g. `model_type: qwen2_5_vl`)."
            )
        tokenizer = processor.tokenizer
        token_ids = {field: getattr(processor, field, None) for field in _TOKEN_FIELDS}
        token_ids.update({field: tokenizer.convert_tokens_to_ids(token) for field, token in
                          (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))
                          if token in tokenizer.get_vocab()})
        text_config = {"vocab_size": len(tokenizer), **block.pop("text_config", {})}
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            text_config.setdefault(name, getattr(tokenizer, name))
        config = AutoConfig.for_model(model_type, text_config=text_config, **block,
                                      **{k: v for k, v in token_ids.items() if isinstance(v, int)})
        model = AutoModelForImageTextToText.from_config(config, dtype=None if dtype == "auto" else dtype,
                                                        attn_implementation=model_args.attn_implementation)
    model.config.use_cache = False
    if hasattr(model.config, "text_config"):
        model.config.text_config.use_cache = False
    return model


def _count(documents, name: str | None) -> int:
    if name is None:
        return 0
    column = documents.with_format("arrow")[name]
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return int(pc.sum(pc.list_value_length(column)).as_py() or 0)
    return len(column) - column.null_count

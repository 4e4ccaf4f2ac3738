"""`PackedSFTTrainer`: TRL's `SFTTrainer`, packed, with one import changed.

It takes the datasets `SFTTrainer` takes (text, conversational, prompt-completion, tokenized; see `sft_data.py`),
prepares them with TRL's own code and packs each split at once with `pack_dataset`; rows `pack_dataset` made already
are trained as they are. Stock `SFTTrainer` given packed rows with its defaults cuts them to `SFTConfig.max_length`
(1024) and collates them with an all-ones mask, so documents attend to each other; this subclass keeps TRL's training
loop, loss and logging, and changes only what packed rows need: our
[`~llm_packing.batches.collator.DataCollatorWithPacking`], the hook configured and verified on the model. Every setting
that would cut or mix documents raises a [`~llm_packing.errors.PackingError`] from the constructor.
"""

import copy
import os

from trl import SFTTrainer
from trl.trainer.utils import global_then_local_main_first

from ..batches.collator import DataCollatorWithPacking
from ..core.checks import check_bool, check_integer
from ..core.overflow import check_overflow_policy
from ..errors import ContaminationError, UnsupportedSetupError
from ..hook.configure import is_packing_configured
from ..hook.verify import configure_and_verify
from . import neftune, sequence_parallel, sft_checks
from .image_text import PACKED_COLUMNS, prepare_image_text
from .sft_data import is_packed, pack_documents
from .token_counts import recount_num_tokens, with_binary_mask


class PackedSFTTrainer(SFTTrainer):
    """
    TRL's [`~trl.SFTTrainer`], packed: same arguments, same datasets, and every document trained exactly as if it were
    alone (it attends only to itself, its positions restart at 0, and it is never trained to predict the next
    document's first token).

    Datasets (TRL's formats, see [`~llm_packing.trainers.sft_data`]):
    - language modeling (`text`, or `dataset_text_field`; any columns with `formatting_func`), conversational
      (`messages`, or ShareGPT `conversations`), prompt-completion (`prompt` + `completion`, plain or conversational),
      or tokenized (`input_ids`, optional `labels`, `completion_mask`, `assistant_masks`): prepared by TRL's own
      `SFTTrainer._prepare_dataset` (chat template, `chat_template_path`, `eos_token`, tools, `assistant_only_loss`,
      `completion_only_loss`), then packed, each split at once, by [`~llm_packing.data.pack.pack_dataset`] into rows
      of `SFTConfig.max_length` tokens (1024 by default). Documents longer than that follow `overflow`;
    - rows made by `pack_dataset` (`input_ids` + `seq_lengths`): trained as they are, at the `max_length` they were
      packed to (`SFTConfig`'s default 1024 then counts as unset, with a warning when the rows are longer).

    On top of `SFTTrainer`: batches are collated by [`~llm_packing.batches.collator.DataCollatorWithPacking`]
    (indexed `attention_mask`, restarting `position_ids`, -100 on each document's first label); when rows hold several
    documents, [`~llm_packing.configure_packing`] is applied to the model (process-wide; it stays applied after
    training) and [`~llm_packing.verify_packing`] checks it, unless `verify_packing=False`.

    Refused with a [`~llm_packing.errors.PackingError`] before the first step: a dataset in none of these formats, any
    other collator (TRL's pads packed rows into one attention span), `packing=True` or `padding_free=True` in the
    `SFTConfig` (TRL would re-pack or flatten the rows with its own collator), `assistant_only_loss=True` with rows
    packed already (it needs the conversations), `max_length=None` with a dataset to pack, a `max_length` that differs
    between `pack_dataset`, the collator and the `SFTConfig`, packed rows longer than that `max_length`,
    `skip_prepare_dataset` with a dataset that is not packed, accelerate's context or sequence parallelism (`cp_size`,
    `sp_size`: they drop the per-document mask; use `sequence_parallel_size`), and a model the hook cannot isolate.

    Image-text conversations in TRL's vision format (`messages` + `images`, the model's processor as
    `processing_class`) are packed here, at `SFTConfig.max_length`, by their token counts with images expanded, and
    collated by the processor (`assistant_only_loss` applies); see `trainers/image_text.py` and docs/images.md.

    Args:
        overflow (`str`, *optional*, defaults to `"truncate"`, `"error"` for image-text conversations):
            Documents longer than `max_length`, in the datasets this trainer packs: `"truncate"` cuts them as
            `trl.SFTTrainer` does (by `SFTConfig.truncation_mode`, dropping examples left without a trained token), so
            the same tokens are trained on; `"split"` keeps every token, cutting them into `max_length` pieces trained
            as separate documents; `"drop"` leaves them out; `"error"` refuses them. Whatever is cut is logged as a
            warning and counted in `packing_stats`. An image-text conversation is never cut inside its images
            (docs/images.md): by default one too long is refused.
        max_docs_per_bin (`int`, *optional*):
            Cap on documents per packed row (bounds FlashAttention's `cu_seqlens`).
        verify_packing (`bool`, *optional*, defaults to `True`):
            Run [`~llm_packing.verify_packing`] on the model after configuring the hook (four forwards of at most 16
            tokens).
        sequence_parallel_size (`int`, *optional*, defaults to `1`):
            Cut each packed row across this many processes (Ulysses, [`~llm_packing.configure_sequence_parallel`]):
            consecutive ranks form a group that reads the same batches, each rank training its piece of every row;
            groups train data-parallel. The model is checked on a packed batch cut across the group (unless
            `verify_packing=False`). Needs a map-style `train_dataset`; evaluation runs whole rows on every rank.
        model, args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs:
            As for [`~trl.SFTTrainer`].

    Attributes:
        packing_stats (`dict[str, PackingStats]`):
            The [`~llm_packing.core.stats.PackingStats`] of each map-style dataset this trainer packed, by TRL's name
            for it (`"train"`, `"eval"`, or the key of an `eval_dataset` dict).

    Example:
    ```python
    >>> import tempfile
    >>> from datasets import Dataset
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> from trl import SFTConfig
    >>> from llm_packing import PackedSFTTrainer
    >>> from llm_packing.demo.chitchat import load_demo_tokenizer
    >>> chats = Dataset.from_dict({"messages": [
    ...     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
    ...     [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}]]})
    >>> model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=32_000, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    >>> args = SFTConfig(output_dir=tempfile.mkdtemp(), assistant_only_loss=True, max_length=32, report_to="none",
    ...                  use_cpu=True, bf16=False)
    >>> tokenizer = load_demo_tokenizer()
    >>> trainer = PackedSFTTrainer(model=model, args=args, train_dataset=chats, processing_class=tokenizer)
    >>> row = trainer.train_dataset[0]
    >>> row["seq_lengths"]
    [13, 11]
    >>> tokenizer.decode([label for label in row["labels"] if label != -100])
    'Ciao</s> Hello</s>'
    >>> trainer.data_collator([row])["attention_mask"]
    tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]])
    >>> from llm_packing import unconfigure_packing
    >>> unconfigure_packing()  # the trainer configured the hook process-wide; it stays until undone

    ```
    """

    def __init__(self, model, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, *, overflow: str | None = None, max_docs_per_bin: int | None = None,
                 verify_packing: bool = True, sequence_parallel_size: int = 1, **kwargs):
        if overflow is not None:
            check_overflow_policy(overflow)
        check_integer("max_docs_per_bin", max_docs_per_bin, optional=True, meaning="documents per packed row")
        check_bool("verify_packing", verify_packing)
        check_integer("sequence_parallel_size", sequence_parallel_size, meaning="ranks a packed row is cut across")
        self._sequence_parallel = (sequence_parallel_size, None)  # (N, this rank's group once configured)
        args = sft_checks.sft_config(args, model)
        image_text = prepare_image_text(args, model, processing_class, data_collator, train_dataset, eval_dataset,
                                        overflow=overflow or "error")
        if image_text is not None:
            args, data_collator = image_text.args, image_text.data_collator
            train_dataset, eval_dataset = image_text.train_dataset, image_text.eval_dataset
        datasets_by_name = {"train_dataset": train_dataset, **sft_checks.eval_datasets(eval_dataset)}
        sft_checks.check_config(args)
        sft_checks.check_datasets(args, data_collator, datasets_by_name, kwargs.get("formatting_func"))
        max_length = sft_checks.agreed_max_length(args, data_collator, datasets_by_name)
        # TRL mutates its config; keep the caller's untouched, as it may go on to build another trainer.
        args = copy.copy(args)
        args.max_length = max_length
        self._packing_options = {"overflow": overflow or "truncate", "max_docs_per_bin": max_docs_per_bin}
        self.packing_stats = {}
        our_collator = data_collator is None
        if our_collator:
            data_collator = DataCollatorWithPacking(max_length=max_length, pad_to_multiple_of=args.pad_to_multiple_of)
        new_output_dir = not os.path.exists(args.output_dir)
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs)
        try:
            if our_collator:
                self.data_collator.pad_token_id = sft_checks.pad_token_id(self._tokenizer)
            if image_text is not None:  # TRL would prune a vision dataset to its raw columns
                self._signature_columns = PACKED_COLUMNS
            sft_checks.check_parallelism(self.accelerator)
            sft_checks.warn_if_rows_are_dropped(self.args, self.train_dataset, self._sequence_parallel[0])
            if sequence_parallel_size > 1:
                self._configure_sequence_parallel(verify_packing, image_text is not None)
            elif sft_checks.several_documents_per_row(
                    [self.train_dataset, *sft_checks.eval_datasets(self.eval_dataset).values()]):
                self._configure_model(verify_packing, processor=None if image_text is None else processing_class)
        except BaseException:
            # Trainer created the output folder; a refused setup leaves nothing behind.
            if new_output_dir and os.path.isdir(args.output_dir) and not os.listdir(args.output_dir):
                os.rmdir(args.output_dir)
            raise

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """TRL's preparation without truncation, then one global `pack_dataset`; packed rows pass as they are."""
        if is_packed(dataset_name, dataset):
            return dataset

        def prepare(documents, max_length):
            # Called again with `max_length` on the tokenized documents to truncate them: no formatting, no shuffle.
            trl_args = copy.copy(args)
            trl_args.max_length = max_length
            first = max_length is None
            trl_args.shuffle_dataset = args.shuffle_dataset and first
            return SFTTrainer._prepare_dataset(self, documents, processing_class, trl_args, False,
                                               formatting_func if first else None, dataset_name)

        packed, stats = pack_documents(dataset, prepare, max_length=args.max_length,
                                       truncation_mode=args.truncation_mode, num_proc=args.dataset_num_proc,
                                       name=dataset_name, main_process_first=global_then_local_main_first,
                                       **self._packing_options)
        if stats is not None:
            self.packing_stats[dataset_name] = stats
        return packed

    def _configure_sequence_parallel(self, verify: bool, image_text: bool) -> None:
        size = self._sequence_parallel[0]
        if image_text:
            raise UnsupportedSetupError(
                f"`sequence_parallel_size`={size} with image-text conversations: image-text rows are not proven under "
                "sequence parallelism. Set `sequence_parallel_size: 1`."
            )
        if self.args.neftune_noise_alpha is not None:
            raise UnsupportedSetupError(
                f"`sequence_parallel_size`={size} with `neftune_noise_alpha`={self.args.neftune_noise_alpha}: "
                "NEFTune's noise follows each document's length, which a rank holding a piece of a document cannot "
                "read. Set "
                "`sequence_parallel_size: 1`, or leave NEFTune off."
            )
        where = f"[rank {self.args.process_index}/{self.args.world_size}] "
        self._sequence_parallel = (size, sequence_parallel.setup(self, size, verify, where))

    def _get_train_sampler(self, train_dataset=None):
        size = self._sequence_parallel[0]
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if size == 1:
            return super()._get_train_sampler(train_dataset)
        return sequence_parallel.RepeatedBatches(
            len(dataset), self.args.train_batch_size, size, seed=self.args.data_seed or self.args.seed,
            shuffle=self.args.train_sampling_strategy != "sequential", drop_last=self.args.dataloader_drop_last)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss; under sequence parallelism, on this rank's piece of the batch (training only: evaluation runs
        whole rows on every rank). TRL's `num_tokens` log counts tokens, not the indexed mask's sum
        (`token_counts.py`)."""
        _refuse_documents_without_the_hook(inputs)
        rows, group = inputs, self._sequence_parallel[1]
        if group is not None and model.training:
            inputs, num_items_in_batch = sequence_parallel.piece_of(inputs, group, num_items_in_batch)
        counts_tokens = self.model.training and "attention_mask" in rows and hasattr(self, "_total_train_tokens")
        total_before = self._total_train_tokens if counts_tokens else None
        with neftune.batch_positions(inputs):
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        if counts_tokens:  # TRL summed the indexed mask (of a piece's padded rows, under sequence parallelism)
            recount_num_tokens(self, rows, total_before, ranks_per_batch=self._ranks_per_batch())
        return loss

    def train(self, *args, **kwargs):
        """`Trainer.train`, with NEFTune's noise per document (`neftune.py`): transformers' own hook scales it by the
        packed row's length."""
        alpha, self.neftune_noise_alpha = self.neftune_noise_alpha, None
        handle = None if alpha is None else neftune.activate(self.model, alpha, self.accelerator)
        try:
            return super().train(*args, **kwargs)
        finally:
            self.neftune_noise_alpha = alpha
            if handle is not None:
                neftune.deactivate(self.model, handle, self.accelerator)

    def _track_num_input_tokens(self, inputs):
        """transformers' `include_num_input_tokens_seen="non_padding"`, counting tokens, not document numbers, and
        each batch once: under sequence parallelism the ranks of a group all hold the whole batch."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(with_binary_mask(inputs))
        counted = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + counted // self._ranks_per_batch()

    def _ranks_per_batch(self) -> int:
        """How many ranks hold each batch: the sequence-parallel group's size while it trains, else 1."""
        return self._sequence_parallel[0] if self._sequence_parallel[1] is not None and self.model.training else 1

    def _configure_model(self, verify: bool, processor=None) -> None:
        where = f"[rank {self.args.process_index}/{self.args.world_size}] " if self.args.world_size > 1 else ""
        configure_and_verify(self.model, verify=verify, where=where, processor=processor,
                             autocast=self.accelerator.autocast)


def _refuse_documents_without_the_hook(inputs) -> None:
    """A batch of packed rows (an indexed mask) reaching the model after `unconfigure_packing()`: the collator checks
    each batch, but a DataLoader worker goes by the main process when the workers started."""
    mask = inputs.get("attention_mask")
    if mask is None or is_packing_configured() or mask.dim() != 2 or int(mask.max()) <= 1:
        return
    raise ContaminationError(
        "PackedSFTTrainer got a batch of packed rows (an indexed `attention_mask` with several documents a row), but "
        "packing is not configured any more (`unconfigure_packing()` during training?): the documents would attend "
        "to each other. Call `llm_packing.configure_packing(trainer.model)` again before training on."
    )

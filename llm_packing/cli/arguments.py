"""`PackingArguments`: the packing keys of a training recipe, parsed beside TRL's `SFTConfig` and `ModelConfig`.

A recipe is flat YAML (`block_diag_attn: true`, `max_length: 1024`, `learning_rate: 1e-3`, ...): `HfArgumentParser`
hands each key to the dataclass that has a field of that name. `max_length` (row capacity) and
`per_device_train_batch_size` (rows per batch) come from `SFTConfig`; the keys below say how documents are put into
those rows.
"""

from dataclasses import dataclass, field

from ..core.checks import check_choice, check_integer
from ..core.overflow import OVERFLOW_POLICIES
from ..errors import PackingTypeError, PackingValueError
from ..hook.attention.route import ROUTES


PACKING_STRATEGIES = ("bfd", "ffd", "wfd", "nf")  # the strategies of `llm_packing.core.binpack.pack_sequences`
PACKING_ENGINES = ("local", "ray")


@dataclass
class PackingArguments:
    """
    How tokenized documents are packed into training rows, and how the model is kept from mixing them.

    Args:
        block_diag_attn (`bool`, *optional*, defaults to `True`):
            Pack documents into rows of `max_length` tokens with block-diagonal attention (each document attends only
            to itself, positions restart per document). `False` trains the same documents unpacked, one per row in
            padded batches: the reference that packed training must match.
        packing_strategy (`str`, *optional*, defaults to `"bfd"`):
            Bin-packing strategy: `"bfd"` (best-fit decreasing, tightest), `"ffd"` (first-fit decreasing), `"wfd"`
            (worst-fit decreasing, balances row fill) or `"nf"` (next-fit, keeps document order).
        overflow (`str`, *optional*, defaults to `"error"`):
            Documents longer than `max_length`: `"error"`, `"truncate"` (keep the first `max_length` tokens),
            `"split"` (cut into `max_length` chunks trained as separate documents) or `"drop"`.
        max_docs_per_bin (`int`, *optional*):
            Cap on documents per row (e.g. to bound FlashAttention's `cu_seqlens` on rows of thousands of documents).
        padding_free (`bool`, *optional*, defaults to `False`):
            Flatten each batch into one row with `position_ids` and no attention mask, isolated by transformers' own
            packed-sequence detection, instead of rows with an indexed attention mask.
        packing_seed (`int`, *optional*):
            Seed for pairing documents of equal length differently; `None` packs deterministically.
        attention_route (`str`, *optional*, defaults to `"auto"`):
            How sdpa attends packed rows: `"auto"` takes the varlen route (each document's own causal block, memory
            linear in tokens) where the architecture allows it, `"dense"` forces transformers' `L x L` packed mask,
            `"varlen"` stops with an error unless the varlen route is taken. See `configure_packing`.
        verify_packing (`bool`, *optional*, defaults to `True`):
            Before training, run a tiny packed batch and its documents alone through the model and stop with
            `ContaminationError` if their logits differ (four forwards of at most 8 tokens).
        sequence_parallel_size (`int`, *optional*, defaults to `1`):
            Cut each packed row across this many processes (Ulysses sequence parallelism, `llm_packing.parallel`):
            each holds a contiguous piece of the row, and attention exchanges pieces for heads so that every
            document attends over the whole row exactly as alone. It must divide the number of processes and
            `num_attention_heads`; consecutive processes form a group, groups train data-parallel. sdpa only.
        packing_engine (`str`, *optional*, defaults to `"local"`):
            Where the documents are packed: `"local"` (`pack_dataset` in this process, `dataset_num_proc` processes
            writing) or `"ray"` (`pack_dataset_on_ray`: the gather as Ray tasks on a cluster; needs
            `pip install 'llm_packing[ray]'`). The rows are the same.
        ray_address (`str`, *optional*):
            The Ray cluster of `packing_engine: ray`, as `ray.init(address=...)` takes it (`auto`,
            `ray://head:10001`); `null` joins the one `RAY_ADDRESS` names, or starts one on this machine.
        packed_dir (`str`, *optional*):
            Where `packing_engine: ray` writes the packed shards, on storage the cluster and every training rank
            share; defaults to `<output_dir>/packed_rows`. Must hold no shards yet.
    """

    block_diag_attn: bool = field(
        default=True,
        metadata={
            "help": "Pack documents into rows with block-diagonal attention (no attention across documents, positions "
            "restarting per document). False trains the same documents unpacked, one per padded row."
        },
    )
    packing_strategy: str = field(
        default="bfd",
        metadata={"help": "Bin-packing strategy.", "choices": list(PACKING_STRATEGIES)},
    )
    overflow: str = field(
        default="error",
        metadata={
            "help": "What to do with documents longer than max_length: error, truncate, split (into max_length "
            "chunks) or drop. (`llm-packing stats` defaults to split.)",
            "choices": list(OVERFLOW_POLICIES),
        },
    )
    max_docs_per_bin: int | None = field(
        default=None, metadata={"help": "Cap on documents per packed row (bounds FlashAttention's cu_seqlens)."}
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Flatten each batch into one row with position_ids and no mask (not the indexed mask)."
        },
    )
    packing_seed: int | None = field(
        default=None,
        metadata={"help": "Seed for which equal-length documents share a row; None packs deterministically."},
    )
    attention_route: str = field(
        default="auto",
        metadata={
            "help": "sdpa for packed rows: auto (by device and length), dense (L x L mask), varlen.",
            "choices": list(ROUTES),
        },
    )
    verify_packing: bool = field(
        default=True,
        metadata={
            "help": "Before training, check that a tiny packed batch gives the same logits as its documents alone, "
            "and stop with ContaminationError if not."
        },
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "Cut each packed row across this many processes (Ulysses); divides processes and heads."},
    )

    packing_engine: str = field(
        default="local",
        metadata={"help": "Where documents are packed: local (pack_dataset) or ray (pack_dataset_on_ray; pip "
                  "install 'llm_packing[ray]').", "choices": list(PACKING_ENGINES)},
    )
    ray_address: str | None = field(
        default=None,
        metadata={"help": "Ray cluster for packing_engine: ray (auto, ray://head:10001); null: RAY_ADDRESS or a "
                  "local one."},
    )
    packed_dir: str | None = field(
        default=None,
        metadata={"help": "Shared folder of packing_engine: ray's shards (default <output_dir>/packed_rows)."},
    )

    def __post_init__(self):
        for name in ("block_diag_attn", "padding_free", "verify_packing"):
            if not isinstance(getattr(self, name), bool):
                raise PackingTypeError(
                    f"`{name}` must be true or false, got {getattr(self, name)!r}. Write `{name}: true` or "
                    f"`{name}: false` in the recipe."
                )
        _check_choice("packing_strategy", self.packing_strategy, PACKING_STRATEGIES, "bfd is the tightest")
        _check_choice("overflow", self.overflow, OVERFLOW_POLICIES, "split keeps every token")
        _check_choice("attention_route", self.attention_route, ROUTES, "auto is the fastest exact route")
        _check_choice("packing_engine", self.packing_engine, PACKING_ENGINES, "local needs no cluster")
        for name in ("ray_address", "packed_dir"):
            value = getattr(self, name)
            if value is not None and self.packing_engine != "ray":
                raise PackingValueError(
                    f"`{name}: {value}` is read by `packing_engine: ray` only, but `packing_engine` is "
                    f"{self.packing_engine!r}. Set `packing_engine: ray`, or remove `{name}`."
                )
        for name in ("max_docs_per_bin", "packing_seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise PackingTypeError(f"`{name}` must be an integer or null, got {value!r}.")
        check_integer("max_docs_per_bin", self.max_docs_per_bin, optional=True, meaning="no cap",
                      fix="Write `max_docs_per_bin: null` in the recipe for no cap.")
        check_integer("sequence_parallel_size", self.sequence_parallel_size, meaning="processes a row is cut across",
                      fix="Write `sequence_parallel_size: 1` in the recipe for no sequence parallelism.")
        if self.sequence_parallel_size > 1 and (self.padding_free or not self.block_diag_attn):
            raise PackingValueError(
                f"`sequence_parallel_size: {self.sequence_parallel_size}` cuts rows with an indexed attention mask, "
                "but `padding_free: true` or `block_diag_attn: false` leaves none. Set `block_diag_attn: true` and "
                "`padding_free: false`, or `sequence_parallel_size: 1`."
            )
        check_integer("packing_seed", self.packing_seed, minimum=0, optional=True,
                      fix="Write `packing_seed: null` in the recipe to pack deterministically.")
        if self.padding_free and not self.block_diag_attn:
            raise PackingValueError(
                "`padding_free: true` flattens packed documents into one row, but `block_diag_attn: false` asks for "
                "unpacked training. Set `block_diag_attn: true` to pack padding-free, or `padding_free: false`."
            )


def _check_choice(name: str, value, allowed: tuple[str, ...], hint: str) -> None:
    check_choice(name, value, allowed, fix=f"Set `{name}:` to one of those in the recipe ({hint}).")

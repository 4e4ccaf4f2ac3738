"""transformers' `Trainer` keeps the packed rows' `seq_lengths` while packing is configured.

With its default `remove_unused_columns=True`, `Trainer` drops every dataset column that the model's `forward` does
not name before the collator sees a row. `seq_lengths` is one: a `pack_dataset` row then reached
`DataCollatorWithPacking` as a single example, one document of the whole row, with positions running on and an
all-ones mask, so its documents attended to each other and each learned to predict the next one's first token,
silently (the collator takes examples without `seq_lengths` as unpacked). While packing is configured, or once a
`DataCollatorWithPacking` is built (so that it sees packed rows, and refuses them for an unconfigured model),
`Trainer`'s own choice of columns keeps `seq_lengths` too: the collator consumes it and never hands it to the model.
TRL's trainers choose their columns themselves (and keep it), so only `Trainer`'s default is extended.

`transformers.trainer` is never imported here: importing it costs about a second and, with DeepSpeed installed, prints
DeepSpeed's accelerator line into a `verify` run's output. `configure_packing` and `DataCollatorWithPacking` both call
[`keep_packing_columns`]: it patches `Trainer` where `transformers.trainer` is imported already, and otherwise as soon
as it is (`registry.patch_on_import`), so the order of a notebook's imports does not matter.
"""

import functools
import sys
import weakref

from ..errors import ContaminationError
from . import registry


PACKING_COLUMNS = ("seq_lengths",)
_TRAINER_MODULE = "transformers.trainer"


_collators: list[weakref.ref] = []  # the `DataCollatorWithPacking`s alive, for `keep_columns_for_live_collators`


def keep_packing_columns_for(collator) -> None:
    """For a `DataCollatorWithPacking` just built: [`keep_packing_columns`] now, without making packing configured
    when it is not, and again after each `unconfigure_packing` while the collator lives."""
    _collators[:] = [alive for alive in _collators if alive() is not None]
    _collators.append(weakref.ref(collator))
    keep_packing_columns(configures=registry.is_active())


def keep_columns_for_live_collators() -> None:
    """After `unconfigure_packing`: a `DataCollatorWithPacking` still alive must still get `seq_lengths`, to refuse
    packed rows for the model no longer configured instead of taking each as one document."""
    if any(alive() is not None for alive in _collators):
        keep_packing_columns(configures=False)


def keep_packing_columns(*, configures: bool = True) -> None:
    """Extend `transformers.Trainer`'s kept columns with `PACKING_COLUMNS`, now if `transformers.trainer` is imported,
    else when it is (idempotent; restored through the registry). `configures=False` for a `DataCollatorWithPacking`
    built while nothing is configured: the collator must see `seq_lengths` to refuse packed rows then, but the patch
    does not make packing configured."""
    registry.patch_on_import(_TRAINER_MODULE, functools.partial(_extend_trainer_columns, configures),
                             configures=configures)


def _extend_trainer_columns(configures: bool) -> None:
    trainer = sys.modules[_TRAINER_MODULE]
    original = trainer.Trainer._set_signature_columns_if_needed
    if not registry.is_ours(original):
        replacement = registry.ours(_keeping_packing_columns(original), eager=False)
        registry.replace_attribute(trainer.Trainer, "_set_signature_columns_if_needed", replacement,
                                   configures=configures)


def refuse_packed_rows_in_flattening_collator() -> None:
    """While packing is configured, transformers' `DataCollatorWithFlattening` refuses rows that carry `seq_lengths`
    (`pack_dataset`'s): it takes each row as one sequence, so the documents of a packed row attended to each other
    (0.68 off alone on a configured tiny Llama), and the batch's restarting `position_ids` pass the model's guard.
    Idempotent; restored through the registry."""
    from transformers.data.data_collator import DataCollatorWithFlattening

    original = DataCollatorWithFlattening.__call__
    if not registry.is_ours(original):
        registry.replace_attribute(DataCollatorWithFlattening, "__call__", registry.ours(
            _refusing_packed_rows(original), eager=False))


def _refusing_packed_rows(original):
    @functools.wraps(original)
    def flatten_unpacked_rows(self, features, *args, **kwargs):
        if any(isinstance(feature, dict) and "seq_lengths" in feature for feature in features):
            raise ContaminationError(
                "`DataCollatorWithFlattening` got rows with `seq_lengths` (`pack_dataset`'s packed rows): it flattens "
                "each row as one sequence, so the documents of a row would attend to each other. Collate packed rows "
                "with `llm_packing.DataCollatorWithPacking()` (or flatten them with "
                "`DataCollatorWithPacking(padding_free=True)`, which restarts positions per document)."
            )
        return original(self, features, *args, **kwargs)

    return flatten_unpacked_rows


def _keeping_packing_columns(original):
    @functools.wraps(original)
    def set_signature_columns_keeping_packing_columns(self) -> None:
        original(self)
        missing = [column for column in PACKING_COLUMNS if column not in self._signature_columns]
        if missing:
            self._signature_columns = [*self._signature_columns, *missing]

    return set_signature_columns_keeping_packing_columns

"""transformers' `Trainer` keeps the packed rows' `seq_lengths` while packing is configured.

With its default `remove_unused_columns=True`, `Trainer` drops every dataset column that the model's `forward` does
not name before the collator sees a row. `seq_lengths` is one: a `pack_dataset` row then reached
`DataCollatorWithPacking` as a single example, one document of the whole row, with positions running on and an
all-ones mask, so its documents attended to each other and each learned to predict the next one's first token,
silently (the collator takes examples without `seq_lengths` as unpacked). While packing is configured, `Trainer`'s
own choice of columns keeps `seq_lengths` too: the collator consumes it and never hands it to the model. TRL's trainers
choose their columns themselves (and keep it), so only `Trainer`'s default is extended.

`transformers.trainer` is patched where it is imported already, never imported here: importing it costs about a second
and, with DeepSpeed installed, prints DeepSpeed's accelerator line into a `verify` run's output. `configure_packing`
and `DataCollatorWithPacking` both call [`keep_packing_columns`], so a `Trainer` imported before either is covered.
"""

import functools
import sys

from . import registry


PACKING_COLUMNS = ("seq_lengths",)


def keep_packing_columns() -> None:
    """Extend `transformers.Trainer`'s kept columns with `PACKING_COLUMNS`, if `transformers.trainer` is imported
    (idempotent; restored through the registry)."""
    trainer = sys.modules.get("transformers.trainer")
    if trainer is None:
        return
    original = trainer.Trainer._set_signature_columns_if_needed
    if not registry.is_ours(original):
        replacement = registry.ours(_keeping_packing_columns(original), eager=False)
        registry.replace_attribute(trainer.Trainer, "_set_signature_columns_if_needed", replacement)


def _keeping_packing_columns(original):
    @functools.wraps(original)
    def set_signature_columns_keeping_packing_columns(self) -> None:
        original(self)
        missing = [column for column in PACKING_COLUMNS if column not in self._signature_columns]
        if missing:
            self._signature_columns = [*self._signature_columns, *missing]

    return set_signature_columns_keeping_packing_columns

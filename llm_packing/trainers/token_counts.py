"""Tokens counted for the logs, on batches whose `attention_mask` is indexed.

TRL's `num_tokens` metric and transformers' `include_num_input_tokens_seen="non_padding"` count a batch's tokens as
`attention_mask.sum()`. An indexed mask holds each token's document number, so that sum overcounts:
`[1, 1, 2, 2, 2, 0]` holds 5 tokens and sums to 8, and a row of 20 documents counts its last document 20 times. A
token is a non-zero mask entry, whatever the number.
"""


def with_binary_mask(inputs: dict) -> dict:
    """`inputs` with its `attention_mask` (if any) as 1 on tokens and 0 on padding, for counting only.

    Example:
    ```python
    >>> import torch
    >>> with_binary_mask({"attention_mask": torch.tensor([[1, 1, 2, 2, 2, 0]])})["attention_mask"]
    tensor([[1, 1, 1, 1, 1, 0]])

    ```
    """
    mask = inputs.get("attention_mask")
    if mask is None:
        return inputs
    return {**inputs, "attention_mask": mask.ne(0).to(mask.dtype)}


def recount_num_tokens(trainer, inputs: dict, total_before: int, ranks_per_batch: int = 1) -> None:
    """Set TRL's `num_tokens` after `trainer.compute_loss` counted `inputs` by their mask's sum: `total_before` plus
    the tokens of `inputs` on every rank, as TRL gathers them, divided by the ranks that share a batch (tensor
    parallelism's, and `ranks_per_batch`: a sequence-parallel group's, each rank holding the whole rows). Gathered
    whole under sequence parallelism: `gather_for_metrics` would cut the epoch's last batch to the rows accelerate
    takes for new, and every rank of a group holds the same ones."""
    mask = inputs["attention_mask"]
    gather = trainer.accelerator.gather if ranks_per_batch > 1 else trainer.accelerator.gather_for_metrics
    tokens = gather(mask.ne(0).sum()).sum().item()
    trainer._total_train_tokens = total_before + tokens // (getattr(trainer, "_tp_size", 1) * ranks_per_batch)
    trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]


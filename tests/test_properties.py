"""Properties of the whole data path, `pack_dataset` then `DataCollatorWithPacking`, on random datasets.

- Conservation: every kept token and label reaches the batch exactly once, in its document, and what is kept is exactly
  what the `overflow` policy says (`error` raises iff a document is too long; `truncate` keeps the first `max_length`
  tokens; `split` keeps every token, as `max_length` chunks; `drop` leaves the document out); the stats count the rest.
- Isolation: every document's first label is -100, positions restart at 0, the indexed mask numbers documents
  1, 2, 3, ... per row, and FlashAttention's `cu_seq_lens` has one segment per document plus one per row's padding.
- Capacity: no row over `max_length`, no row over `max_docs_per_bin` documents.
- Determinism: a fixed seed packs identically in fresh processes (with different hash seeds) and in this one.
"""

import hashlib
import json
import os
import subprocess
import sys

import datasets
import numpy as np
import pytest
from datasets import Dataset
from hypothesis import HealthCheck, given, settings, strategies as st

from llm_packing import STRATEGIES, DataCollatorWithPacking, SequenceTooLongError, get_seqlens_in_batch, pack_dataset


IGNORE = -100
INT_LISTS = datasets.List(datasets.Value("int64"))
PAD = 0


@st.composite
def tokenized(draw):
    """Random documents (empty ones included) with optional `labels` and `completion_mask`."""
    lengths = draw(st.lists(st.integers(0, 14), min_size=1, max_size=25))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    columns = {"input_ids": [rng.integers(1, 5000, n).tolist() for n in lengths]}
    if draw(st.booleans()):
        columns["labels"] = [np.where(rng.random(n) < 0.3, IGNORE, rng.integers(0, 5000, n)).tolist() for n in lengths]
    if draw(st.booleans()):
        columns["completion_mask"] = [(rng.random(n) < 0.7).astype(int).tolist() for n in lengths]
    return columns


def trained_labels(columns):
    """Per document, the label each token is trained on before packing (-100 where masked out)."""
    labels = columns.get("labels", columns["input_ids"])
    masks = columns.get("completion_mask", [[1] * len(ids) for ids in columns["input_ids"]])
    return [[label if keep else IGNORE for label, keep in zip(doc, mask, strict=True)]
            for doc, mask in zip(labels, masks, strict=True)]


def expected_documents(columns, max_length, overflow):
    """The `overflow` policy's contract: the (tokens, labels) of every document that must reach the batch."""
    out = []
    for ids, labels in zip(columns["input_ids"], trained_labels(columns), strict=True):
        n = len(ids)
        if n == 0 or (n > max_length and overflow == "drop"):
            continue
        if n > max_length and overflow == "split":
            spans = [(start, min(start + max_length, n)) for start in range(0, n, max_length)]
        else:
            spans = [(0, min(n, max_length))]
        # The model shifts labels: a document's first label must be -100, or it would predict the previous one's end.
        out += [(tuple(ids[start:stop]), (IGNORE, *labels[start + 1 : stop])) for start, stop in spans]
    return sorted(out)


def documents_in_batch(batch, max_length, max_docs_per_bin):
    """Decode the indexed-mask batch back into documents, checking the layout invariants on the way."""
    ids, labels, positions, mask = (batch[key].numpy() for key in ("input_ids", "labels", "position_ids",
                                                                    "attention_mask"))
    assert ids.shape == labels.shape == positions.shape == mask.shape
    found = []
    for row in range(len(mask)):
        real = np.flatnonzero(mask[row])
        assert len(real) <= max_length
        assert np.array_equal(real, np.arange(len(real))), "padding only at the end of a row"
        pad = slice(len(real), None)
        assert (ids[row, pad] == PAD).all() and (labels[row, pad] == IGNORE).all() and (positions[row, pad] == 0).all()
        number_of_documents = int(mask[row].max())
        assert number_of_documents <= max_docs_per_bin
        for document in range(1, number_of_documents + 1):
            tokens = np.flatnonzero(mask[row] == document)
            assert len(tokens) and np.array_equal(tokens, np.arange(tokens[0], tokens[0] + len(tokens)))
            assert np.array_equal(positions[row, tokens], np.arange(len(tokens)))
            found.append((tuple(ids[row, tokens].tolist()), tuple(labels[row, tokens].tolist())))
    return found


def check_flash_segments(features, mask_batch, pad_to_multiple_of):
    """`cu_seq_lens` of the flash layout: each row's documents, then its padding as one segment."""
    flash = DataCollatorWithPacking(return_flash_attn_kwargs=True, pad_to_multiple_of=pad_to_multiple_of)(features)
    segments = np.diff(flash["cu_seq_lens_q"].numpy())
    width = mask_batch["attention_mask"].shape[1]
    expected = []
    for feature in features:
        expected += list(feature["seq_lengths"])
        if width > sum(feature["seq_lengths"]):
            expected.append(width - sum(feature["seq_lengths"]))
    assert segments.tolist() == expected
    assert flash["max_length_q"] == max(expected)
    assert get_seqlens_in_batch(mask_batch["attention_mask"]).tolist() == [
        n for feature in features for n in feature["seq_lengths"]
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    columns=tokenized(),
    max_length=st.integers(1, 16),
    overflow=st.sampled_from(["error", "truncate", "split", "drop"]),
    strategy=st.sampled_from(STRATEGIES),
    seed=st.none() | st.integers(0, 2**16),
    max_docs_per_bin=st.none() | st.integers(1, 4),
    batch_size=st.integers(1, 5),
    pad_to_multiple_of=st.none() | st.integers(2, 8),
    streaming=st.booleans(),
)
def test_every_token_and_label_reaches_the_batch_as_the_policy_says(
    columns, max_length, overflow, strategy, seed, max_docs_per_bin, batch_size, pad_to_multiple_of, streaming
):
    ds = Dataset.from_dict(columns, features=datasets.Features(dict.fromkeys(columns, INT_LISTS)))
    options = {"overflow": overflow, "strategy": strategy, "seed": seed, "max_docs_per_bin": max_docs_per_bin}
    lengths = [len(ids) for ids in columns["input_ids"]]
    def pack():
        if streaming:
            return list(pack_dataset(ds.to_iterable_dataset(), max_length, buffer_size=4, **options))
        return pack_dataset(ds, max_length, **options)

    if overflow == "error" and max(lengths) > max_length:
        # A stream names the first over-long document it meets; map-style names the longest.
        longest = "" if streaming else f".*the longest has {max(lengths)} tokens"
        with pytest.raises(SequenceTooLongError, match=rf"longer than `max_length`={max_length}{longest}"):
            pack()
        return
    if streaming:
        rows = list(pack_dataset(ds.to_iterable_dataset(), max_length, buffer_size=4, **options))
    else:
        packed, stats = pack_dataset(ds, max_length, return_stats=True, **options)
        rows = packed.to_list()
        # Nothing lost silently: every token is kept, dropped or truncated, and counted as such.
        total = sum(lengths)
        assert stats.num_tokens + stats.dropped_tokens + stats.truncated_tokens == total
        assert stats.empty_sequences == lengths.count(0)
        too_long = [n for n in lengths if n > max_length]
        assert stats.dropped_tokens == (sum(too_long) if overflow == "drop" else 0)
        assert stats.truncated_tokens == (sum(too_long) - len(too_long) * max_length if overflow == "truncate" else 0)
    assert all(len(row["input_ids"]) <= max_length for row in rows)

    collator = DataCollatorWithPacking(pad_token_id=PAD, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of,
                                       check_model_configured=False)
    found = []
    for start in range(0, len(rows), batch_size):
        features = rows[start : start + batch_size]
        batch = collator(features)
        multiple = pad_to_multiple_of or 1
        assert batch["input_ids"].shape[1] <= -(-max_length // multiple) * multiple
        found += documents_in_batch(batch, max_length, max_docs_per_bin or max_length)
        check_flash_segments(features, batch, pad_to_multiple_of)
    assert sorted(found) == expected_documents(columns, max_length, overflow)


# ---------------------------------------------------------------------------------------------------------------------
# Determinism across processes


def packed_digest(seed: int) -> str:
    """sha256 of everything a seeded run produces: every strategy map-style, a stream, and the collated batches."""
    rng = np.random.default_rng(0)
    ds = Dataset.from_dict({"input_ids": [rng.integers(0, 50_000, n).tolist() for n in rng.integers(0, 200, 1500)]})
    out = {strategy: pack_dataset(ds, 256, strategy=strategy, seed=seed, overflow="split").to_dict()
           for strategy in STRATEGIES}
    out["stream"] = list(pack_dataset(ds.to_iterable_dataset(), 256, seed=seed, overflow="split", buffer_size=300))
    collator = DataCollatorWithPacking(max_length=256, check_model_configured=False)
    rows = pack_dataset(ds, 256, seed=seed, overflow="split").to_list()
    out["batches"] = [{key: value.tolist() for key, value in collator(rows[i : i + 8]).items()}
                      for i in range(0, len(rows), 8)]
    return hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()


@pytest.mark.slow
def test_a_fixed_seed_packs_identically_in_fresh_processes():
    here = os.path.dirname(os.path.abspath(__file__))
    code = "import sys, test_properties; print(test_properties.packed_digest(int(sys.argv[1])))"
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, "1234"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
                 "PYTHONHASHSEED": hash_seed},
        )
        for hash_seed in ("0", "4242")
    ]
    in_process = packed_digest(1234)
    digests = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-2000:]
        digests.append(stdout.strip().splitlines()[-1])
    assert digests == [in_process, in_process]
    assert packed_digest(1235) != in_process  # the seed does reach the packing

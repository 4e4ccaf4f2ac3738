"""The design card's line with TRL: stock `SFTTrainer` on `pack_dataset` rows (what it cuts and mixes, what the hook
refuses), `PackedSFTTrainer` (exact: no row cut, documents isolated, same first-step loss as unpacked), and every
setting that `PackedSFTTrainer` refuses, with its message."""


import gc
import itertools

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict, load_from_disk
from loss_recording import LossRecordingPackedSFTTrainer, LossRecordingSFTTrainer, first_step_loss
from transformers import AutoModelForCausalLM, LlamaConfig
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from llm_packing import (
    ContaminationError,
    DataCollatorWithPacking,
    PackedSFTTrainer,
    PackingTypeError,
    PackingValueError,
    configure_packing,
    is_packing_configured,
    pack_dataset,
    packing_configured,
    unconfigure_packing,
)
from llm_packing.data.metadata import packed_max_length
from llm_packing.demo.chitchat import load_demo_tokenizer


TINY = {"vocab_size": 32_000, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1}
LENGTHS = [5, 9, 14, 3, 21, 7, 11, 2, 17, 6]  # 95 tokens; rows of 32 hold several documents each
MAX_LENGTH = 32
QUIET = {"report_to": "none", "use_cpu": True, "bf16": False, "activation_checkpointing": False, "save_strategy": "no",
         "seed": 0}


@pytest.fixture(autouse=True)
def unhooked():
    yield
    unconfigure_packing()


@pytest.fixture(scope="module")
def tokenizer():
    return load_demo_tokenizer()


def documents(lengths=LENGTHS, seed=0) -> Dataset:
    rng = np.random.default_rng(seed)
    input_ids = [rng.integers(10, TINY["vocab_size"], n).tolist() for n in lengths]
    labels = [np.where(rng.random(n) < 0.2, -100, ids).tolist() for n, ids in zip(lengths, input_ids, strict=True)]
    return Dataset.from_dict({"input_ids": input_ids, "labels": labels})


def tiny_model(attn_implementation="sdpa"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation=attn_implementation)


def first_batch(trainer) -> dict:
    return next(iter(trainer.get_train_dataloader()))


def unpacked_first_loss(tmp_path, tokenizer, attn_implementation="sdpa") -> float:
    # One document per row, padded, TRL's own collator and preparation: what every exact packed path must match.
    args = SFTConfig(output_dir=str(tmp_path / "unpacked"), per_device_train_batch_size=len(LENGTHS), max_steps=1,
                     max_length=None, **QUIET)
    trainer = LossRecordingSFTTrainer(model=tiny_model(attn_implementation), args=args, train_dataset=documents(),
                                      processing_class=tokenizer)
    return first_step_loss(trainer)


# -- stock trl.SFTTrainer: the line, reproduced -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("configured", [False, True], ids=["unhooked", "configure_packing"])
def test_stock_sft_trainer_cuts_rows_and_mixes_documents(tmp_path, tokenizer, configured):
    # Rows of 2,048 tokens; SFTConfig's default max_length is 1,024. What TRL hands the model: every row cut, one
    # attention span per row, no position_ids. A configured model refuses that batch at its first training forward
    # (tests/test_sft_trainer.py); an unconfigured one cannot tell it from an unpacked batch.
    packed = pack_dataset(documents([1500, 548, 1000, 1048], seed=1), 2048)
    model = tiny_model()
    if configured:
        configure_packing(model)
    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                                     bf16=False), train_dataset=packed, processing_class=tokenizer)
    batch = first_batch(trainer)
    assert batch["input_ids"].shape == (2, 1024)  # half of every row thrown away
    assert "position_ids" not in batch and bool((batch["attention_mask"] == 1).all())  # one attention span per row


@pytest.mark.slow
def test_stock_trl_return_position_ids_is_refused_by_the_hook(tmp_path, tokenizer):
    packed = pack_dataset(documents(), MAX_LENGTH)
    model = configure_packing(tiny_model())
    collator = DataCollatorForLanguageModeling(pad_token_id=0, return_position_ids=True)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, dataset_kwargs={"skip_prepare_dataset": True}, **QUIET)
    trainer = SFTTrainer(model=model, args=args, train_dataset=packed, processing_class=tokenizer,
                         data_collator=collator)
    with pytest.raises(ContaminationError, match=r"`position_ids` restart inside a row whose `attention_mask` is 0/1"):
        trainer.train()
    assert trainer.state.global_step == 0  # refused before the first optimizer step


def test_hook_refuses_restarting_positions_under_a_plain_mask():
    model = configure_packing(tiny_model()).eval()
    input_ids = torch.arange(10, 16)[None]
    with pytest.raises(ContaminationError, match=r"row 0, token 3: position 0 after 2"):
        model(input_ids, attention_mask=torch.ones(1, 6, dtype=torch.long),
              position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), use_cache=False)
    # Left padding (generation) numbers the real tokens from 0 after the pads: no restart among attended tokens.
    model(input_ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]),
          position_ids=torch.tensor([[1, 1, 0, 1, 2, 3]]), use_cache=False)


@pytest.mark.slow
def test_stock_trl_cutting_rows_before_our_collator_is_refused(tmp_path, tokenizer):
    # Our collator without `skip_prepare_dataset`: TRL cuts `input_ids` to max_length and leaves `seq_lengths` whole.
    packed = pack_dataset(documents(), MAX_LENGTH)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, max_length=16, remove_unused_columns=False, **QUIET)
    trainer = SFTTrainer(model=configure_packing(tiny_model()), args=args, train_dataset=packed,
                         processing_class=tokenizer, data_collator=DataCollatorWithPacking())
    with pytest.raises(PackingValueError, match=r"the row was cut after packing.*PackedSFTTrainer"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.slow
def test_stock_trl_padding_free_on_packed_rows(tmp_path, tokenizer):
    packed = pack_dataset(documents(), MAX_LENGTH)
    # With SFTConfig's default max_length TRL refuses padding-free on rows it will not cut: loud, TRL's own error.
    with pytest.raises(ValueError, match=r"padding_free=True` without packing, `max_length` is not enforced"):
        SFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path), padding_free=True, **QUIET),
                   train_dataset=packed, processing_class=tokenizer)
    # With max_length=None it flattens the batch and restarts positions from `seq_lengths`: exact, hooked or not.
    args = SFTConfig(output_dir=str(tmp_path), padding_free=True, max_length=None, max_steps=1,
                     per_device_train_batch_size=len(packed), **QUIET)
    trainer = LossRecordingSFTTrainer(model=configure_packing(tiny_model()), args=args, train_dataset=packed,
                                      processing_class=tokenizer)
    assert first_step_loss(trainer) == pytest.approx(unpacked_first_loss(tmp_path, tokenizer), abs=1e-5)


# -- PackedSFTTrainer: the supported line ------------------------------------------------------------------------


@pytest.mark.slow
def test_packed_sft_trainer_with_trl_defaults_keeps_rows_whole(tmp_path, tokenizer):
    packed = pack_dataset(documents([1500, 548, 1000, 1048], seed=1), 2048)
    trainer = PackedSFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path), report_to="none",
                                                                  use_cpu=True, bf16=False),
                               train_dataset=packed, processing_class=tokenizer)
    assert trainer.args.max_length == 2048
    batch = first_batch(trainer)
    assert batch["input_ids"].shape == (2, 2048)
    mask, positions, labels = batch["attention_mask"], batch["position_ids"], batch["labels"]
    assert sorted(int(mask[row].max()) for row in range(2)) == [2, 2]  # two documents per row, indexed
    starts = torch.nonzero(positions == 0)
    assert len(starts) == 4 and bool((labels[positions == 0] == -100).all())
    assert bool((positions[mask > 0] > 0).sum() == 2048 * 2 - 4)  # positions restart only at document starts


@pytest.mark.slow
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_sft_trainer_matches_unpacked(tmp_path, tokenizer, attn_implementation):
    packed = pack_dataset(documents(), MAX_LENGTH)
    assert max(map(len, packed["seq_lengths"])) > 1  # several documents share a row
    args = SFTConfig(output_dir=str(tmp_path / "packed"), per_device_train_batch_size=len(packed), max_steps=1,
                     **QUIET)
    trainer = LossRecordingPackedSFTTrainer(model=tiny_model(attn_implementation), args=args, train_dataset=packed,
                                            processing_class=tokenizer)
    packed_loss = first_step_loss(trainer)
    unconfigure_packing()  # the reference runs on a plain model
    assert packed_loss == pytest.approx(unpacked_first_loss(tmp_path, tokenizer, attn_implementation), abs=1e-5)


@pytest.mark.slow
def test_logged_token_counts_are_the_tokens_trained_not_the_indexed_mask_sum(tmp_path, tokenizer):
    # TRL's `num_tokens` and transformers' `num_input_tokens_seen` ("non_padding") sum the attention_mask: on indexed
    # masks that counted document numbers (133 for the first 63 tokens here).
    packed = pack_dataset(documents(), MAX_LENGTH)
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=2, logging_steps=1,
                     include_num_input_tokens_seen="non_padding", **QUIET)
    trainer = PackedSFTTrainer(model=tiny_model(), args=args, train_dataset=packed, processing_class=tokenizer)
    assert int(first_batch(trainer)["attention_mask"].max()) > 2
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "num_tokens" in entry]
    steps_per_epoch = len(logged) // 2
    assert [entry["num_tokens"] for entry in logged][steps_per_epoch - 1 :: steps_per_epoch] == [95, 190]
    assert trainer.state.num_input_tokens_seen == 190


def test_the_trainers_check_runs_under_the_training_autocast(tmp_path, tokenizer, monkeypatch):
    """With `bf16=True` on float32 weights training runs under autocast, where the varlen route takes torch's
    FlashAttention op on CUDA: `verify_packing` runs under the same autocast, so it checks the kernels training runs
    (CPU autocast here), and passes."""
    from llm_packing.hook import verify

    seen, check = [], verify.verify_packing

    def recording(model, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return check(model, **kwargs)

    monkeypatch.setattr(verify, "verify_packing", recording)
    packed = pack_dataset(documents(), MAX_LENGTH)
    for bf16 in (True, False):
        args = SFTConfig(output_dir=str(tmp_path / str(bf16)), **{**QUIET, "bf16": bf16})
        PackedSFTTrainer(model=tiny_model(), args=args, train_dataset=packed, processing_class=tokenizer)
    assert seen == [(True, torch.bfloat16), (False, torch.bfloat16)]


def test_unconfiguring_while_dataloader_workers_run_is_refused(tmp_path, tokenizer):
    """`unconfigure_packing()` after the first step, with a DataLoader worker started while packing was configured:
    the worker's collator cannot see the main process, so the trainer refuses the next packed batch itself (it used to
    train on, the documents attending to each other)."""
    from transformers import TrainerCallback

    class Unconfigure(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            unconfigure_packing()

    args = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=1, dataloader_num_workers=1,
                     **QUIET)
    trainer = PackedSFTTrainer(model=tiny_model(), args=args, train_dataset=pack_dataset(documents(), MAX_LENGTH),
                               processing_class=tokenizer, callbacks=[Unconfigure()], verify_packing=False)
    with pytest.raises(ContaminationError, match="packing is not configured any more"):
        trainer.train()
    assert trainer.state.global_step == 1


@pytest.mark.slow
def test_spawned_dataloader_workers_train(tmp_path, tokenizer):
    """DataLoader workers started by `spawn` (macOS and Windows' default): `PackedSFTTrainer` builds its collator
    before configuring the model, and the workers, whose registry is fresh, go by the main process as they start
    (they refused every batch when they went by the collator's construction)."""
    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, dataloader_num_workers=1,
                     dataloader_prefetch_factor=1, **QUIET)
    trainer = PackedSFTTrainer(model=tiny_model(), args=args, train_dataset=pack_dataset(documents(), MAX_LENGTH),
                               processing_class=tokenizer, verify_packing=False)
    loader = trainer.get_train_dataloader()
    # This platform forks by default; accelerate's loader wraps torch's.
    getattr(loader, "base_dataloader", loader).multiprocessing_context = "spawn"
    batches = list(itertools.islice(loader, 2))
    assert all(int(batch["attention_mask"].max()) > 1 for batch in batches)


@pytest.mark.parametrize("trainer", ["PackedSFTTrainer", "PackedDPOTrainer", "PackedGRPOTrainer",
                                     "PackedRewardTrainer"])
@pytest.mark.parametrize("value", ["false", 0, None])
def test_verify_packing_takes_a_bool(trainer, value):
    """"false" is true: the check ran when asked not to, and `None` or 0 skipped it without a word."""
    import llm_packing

    positional = {"PackedDPOTrainer": (None,), "PackedGRPOTrainer": (None,)}.get(trainer, ())
    with pytest.raises(PackingTypeError, match=rf"`verify_packing` must be a bool \(True or False\), got {value!r}"):
        getattr(llm_packing, trainer)(None, *positional, verify_packing=value)


def test_packed_sft_trainer_leaves_the_callers_config_alone(tmp_path, tokenizer):
    args = SFTConfig(output_dir=str(tmp_path), **QUIET)
    trainer = PackedSFTTrainer(model=tiny_model(), args=args, train_dataset=pack_dataset(documents(), MAX_LENGTH),
                               processing_class=tokenizer, verify_packing=False)
    assert trainer.args.max_length == MAX_LENGTH and trainer.train_dataset is not None
    assert args.max_length == 1024 and args.dataset_kwargs is None
    assert isinstance(trainer.data_collator, DataCollatorWithPacking)
    assert trainer.data_collator.pad_token_id == tokenizer.pad_token_id


# -- PackedSFTTrainer refusals -----------------------------------------------------------------------------------


def packed_rows() -> Dataset:
    return pack_dataset(documents(), MAX_LENGTH)


def test_dropping_the_last_batch_says_how_many_documents_it_drops(tmp_path, tokenizer, caplog):
    """`dataloader_drop_last=True` drops whole packed rows, each of several documents: the trainer says so."""
    rows = packed_rows()
    batch_size = next(size for size in (4, 3, 2) if len(rows) % size)
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=batch_size, dataloader_drop_last=True,
                     **QUIET)
    with caplog.at_level("WARNING", logger="llm_packing"):
        PackedSFTTrainer(model=tiny_model(), args=args, train_dataset=rows, processing_class=tokenizer)
    assert f"drops {len(rows) % batch_size} of the {len(rows)} packed rows each epoch" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="llm_packing"):
        PackedSFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path), **QUIET), train_dataset=rows,
                         processing_class=tokenizer)
    assert "drops" not in caplog.text


@pytest.mark.parametrize("config_max_length", [1024, 2048, None])
def test_rows_longer_than_an_sftconfig_max_length_of_1024_are_warned_of(tmp_path, tokenizer, caplog,
                                                                         config_max_length):
    """1024 is SFTConfig's default, so it counts as unset for packed rows: an explicit 1024 cannot be told apart."""
    rows = pack_dataset(documents([900, 900, 200]), 2048)
    args = SFTConfig(output_dir=str(tmp_path), **QUIET, **({} if config_max_length is None else
                                                           {"max_length": config_max_length}))
    with caplog.at_level("WARNING", logger="llm_packing"):
        trainer = PackedSFTTrainer(model=tiny_model(), args=args, train_dataset=rows, processing_class=tokenizer,
                                   verify_packing=False)
    assert trainer.args.max_length == trainer.data_collator.max_length == 2048
    warned = ("SFTConfig's max_length is 1024, TRL's default, so it was taken as unset: the packed rows' max_length "
              "2048 is used. If you set 1024 yourself, pack with `pack_dataset(..., max_length=1024)`; otherwise "
              "pass `SFTConfig(max_length=2048)` to silence this.")
    assert (warned in caplog.text) == (config_max_length != 2048)
    caplog.clear()
    with caplog.at_level("WARNING", logger="llm_packing"):  # rows shorter than 1024 fit what it would have bounded
        PackedSFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path), **QUIET),
                         train_dataset=packed_rows(), processing_class=tokenizer, verify_packing=False)
    assert "TRL's default" not in caplog.text


@pytest.mark.parametrize("max_length", [32, 3])
def test_truncating_and_dropping_are_each_said_only_when_they_happen(tmp_path, tokenizer, caplog, max_length):
    """An example without a trained token is dropped as TRL drops it, whatever its length: no truncation advice."""
    untrained = Dataset.from_dict({"input_ids": [[1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12]],
                                   "labels": [[-100, 5, 6, 7], [-100, -100, -100], [-100, 10, 11, 12]]})
    with caplog.at_level("WARNING", logger="llm_packing"):
        trainer = PackedSFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path), max_length=max_length,
                                                                      **QUIET),
                                   train_dataset=untrained, processing_class=tokenizer)
    stats = trainer.packing_stats["train"]
    logged = [record.getMessage() for record in caplog.records if record.name.startswith("llm_packing")]
    if max_length == 32:
        assert (stats.truncated_sequences, stats.dropped_sequences) == (0, 1)
        assert logged == ["train: 1 of 3 examples have no trained token (empty, or every label -100) and were "
                          "dropped, as trl.SFTTrainer drops them."]
    else:
        assert (stats.truncated_sequences, stats.dropped_sequences) == (2, 1)
        assert len(logged) == 2 and logged[0].endswith("raise `max_length`.")
        assert logged[0].startswith("train: 2 of 3 documents are longer than max_length=3 and were truncated")
        assert logged[1] == ("train: 1 of 3 examples have no trained token within max_length=3 (empty, or every "
                             "label -100) and were dropped, as trl.SFTTrainer drops them.")


def test_neftune_noise_follows_each_documents_length(tmp_path, tokenizer, monkeypatch):
    """NEFTune's noise is `alpha / sqrt(length x hidden)`: transformers takes the packed row's length, so documents
    got several times less noise than alone. Here each token's noise is within its own document's bound and reaches
    it (about 2,000 draws a document); outside training, and after `train()`, there is none."""
    from llm_packing.trainers import neftune

    model = tiny_model()
    args = SFTConfig(output_dir=str(tmp_path), neftune_noise_alpha=5.0, max_steps=1, **QUIET)
    trainer = PackedSFTTrainer(model=model, args=args, train_dataset=packed_rows(), processing_class=tokenizer)
    batch = trainer.data_collator([packed_rows()[0]])
    embeddings = model.get_input_embeddings()
    clean = embeddings(batch["input_ids"]).detach()
    handle = neftune.activate(model, 5.0, trainer.accelerator)
    try:
        model.train()
        with neftune.batch_positions(batch):
            noise = (embeddings(batch["input_ids"]) - clean).detach()[0]
        model.eval()
        assert torch.equal(embeddings(batch["input_ids"]), clean)
    finally:
        neftune.deactivate(model, handle, trainer.accelerator)
    start, hidden = 0, clean.shape[-1]
    for length in packed_rows()[0]["seq_lengths"]:
        bound = 5.0 / (length * hidden) ** 0.5
        largest = noise[start : start + length].abs().max().item()
        assert 0.9 * bound <= largest <= bound * (1 + 1e-6), (length, largest, bound)
        start += length
    calls = []
    noise_per_document = neftune._noise_per_document
    monkeypatch.setattr(neftune, "_noise_per_document", lambda *a, **k: calls.append(1) or noise_per_document(*a, **k))
    trainer.train()  # with this hook, not transformers' row-length one, and without it afterwards
    assert calls and not embeddings._forward_hooks and trainer.neftune_noise_alpha == 5.0


def test_neftune_noise_follows_each_documents_length_on_replica_threads(tmp_path, tokenizer):
    """`nn.DataParallel` (`Trainer` on several GPUs without a launcher) runs each replica's slice of the batch on a
    thread of its own, where the trainer's thread's `position_ids` are not: each replica reads its documents from its
    own forward's mask (it fell back to the row's length: a 2-token document got 3 times too little noise)."""
    import threading

    from llm_packing.trainers import neftune

    model = tiny_model()
    args = SFTConfig(output_dir=str(tmp_path), neftune_noise_alpha=5.0, max_steps=1, **QUIET)
    trainer = PackedSFTTrainer(model=model, args=args, train_dataset=packed_rows(), processing_class=tokenizer)
    batch = trainer.data_collator(list(packed_rows())[:2])
    embeddings = model.get_input_embeddings()
    clean = embeddings(batch["input_ids"]).detach()
    noise = {}
    handle = neftune.activate(model, 5.0, trainer.accelerator)
    recorder = embeddings.register_forward_hook(  # after NEFTune's: sees the noisy embeddings
        lambda module, args, output: noise.__setitem__(threading.current_thread().name, output.detach()))
    model.train()
    try:
        with neftune.batch_positions(batch):  # the trainer's thread; each replica runs one row, as parallel_apply
            replicas = [threading.Thread(target=model, name=f"replica{row}",
                                         kwargs={key: value[row : row + 1] for key, value in batch.items()})
                        for row in range(2)]
            for replica in replicas:
                replica.start()
            for replica in replicas:
                replica.join()
    finally:
        recorder.remove()
        neftune.deactivate(model, handle, trainer.accelerator)
        model.eval()
    # The draws of the two threads interleave in any order, so a document of 2 tokens (32 draws) may stay under 0.9 of
    # its bound by chance (3%): each document is held to its own bound, a row's documents together reach 0.9 of theirs,
    # and every document under a quarter of the row exceeds the row-length bound it fell back to (never by chance).
    hidden, row_length = clean.shape[-1], clean.shape[1]
    row_bound = 5.0 / (row_length * hidden) ** 0.5
    for row in range(2):
        start, row_noise, reached = 0, (noise[f"replica{row}"] - clean[row : row + 1])[0], []
        for length in packed_rows()[row]["seq_lengths"]:
            bound = 5.0 / (length * hidden) ** 0.5
            largest = row_noise[start : start + length].abs().max().item()
            assert largest <= bound * (1 + 1e-6), (row, length, largest, bound)
            if 4 * length <= row_length:
                assert largest > row_bound, (row, length, largest, row_bound)
            reached.append(largest / bound)
            start += length
        assert max(reached) >= 0.9, (row, reached)


def trl_packed_rows() -> Dataset:
    # TRL's own packer: `seq_lengths` but no record of the max_length, so only the rows' lengths can be checked.
    from trl.data_utils import pack_dataset as trl_pack_dataset

    return trl_pack_dataset(documents(), MAX_LENGTH, strategy="bfd")


@pytest.mark.parametrize(
    ("config", "collator", "dataset", "error", "match"),
    [
        ({"packing": True}, None, None, PackingValueError, r"`packing=True` in the SFTConfig makes TRL pack the rows "
         r"again.*Set `packing=False` \(recipe: `packing: false`\)"),
        ({"padding_free": True, "max_length": None}, None, None, PackingValueError,
         r"`padding_free=True` in the SFTConfig.*DataCollatorWithPacking\(padding_free=True\)"),
        ({"assistant_only_loss": True}, None, None, PackingValueError,
         r"`assistant_only_loss=True`.*`train_dataset` holds rows packed already. Pass the `messages` dataset itself"),
        ({}, DataCollatorForLanguageModeling(pad_token_id=0), None, PackingTypeError,
         r"must be a DataCollatorWithPacking.*TRL's: it ignores `seq_lengths` and sends an all-ones"),
        ({"max_length": 16}, None, None, PackingValueError,
         r"`max_length` differs: pack_dataset \(train_dataset\) 32, SFTConfig 16"),
        ({"max_length": 64}, None, None, PackingValueError, r"`max_length` differs"),
        ({}, DataCollatorWithPacking(max_length=64), None, PackingValueError,
         r"`max_length` differs: pack_dataset \(train_dataset\) 32, DataCollatorWithPacking 64"),
        ({}, None, "questions", PackingValueError,
         r"`train_dataset` has columns \['question'\], in none of the formats trl.SFTTrainer prepares.*"
         r"set `dataset_text_field`"),
        ({"dataset_kwargs": {"skip_prepare_dataset": True}}, None, "unpacked", PackingValueError,
         r"skips the preparation that tokenizes and packs `train_dataset`, whose columns \['input_ids', 'labels'\] "
         r"are not packed rows.*pack_dataset\(tokenized, max_length\)"),
        ({"max_length": None}, None, "unpacked", PackingValueError,
         r"`max_length` is None in the SFTConfig, but PackedSFTTrainer packs `train_dataset`"),
        ({}, None, "prompt-only", PackingValueError, r"`train_dataset` has a `prompt` column but no `completion`"),
        ({"max_length": 16}, None, "trl", PackingValueError,
         r"`train_dataset` has rows of \d+ tokens, longer than `max_length`=16"),
        ({}, None, "empty", PackingValueError,
         r"`train_dataset` leaves nothing to train on: all 2 of its documents are empty once prepared.*filter the "
         r"empty examples out"),
        ({}, None, "empty-or-untrained", PackingValueError,
         r"`train_dataset` leaves nothing to train on: of its 2 documents, 1 are empty and the other 1 were left "
         r"without a trained token within max_length=1024 \(every label -100\), and trl.SFTTrainer drops such"),
        ({}, None, "packed-empty", PackingValueError,
         r"`train_dataset` has no rows, so there is nothing to train on: pack_dataset left out every document"),
        ({}, None, "splits", PackingTypeError, r"`train_dataset` must be a datasets Dataset or IterableDataset, got a "
         r"DatasetDict of the splits \['test', 'train'\]\. Pass one split, e\.g\. `train_dataset=dataset\['train'\]`"),
    ],
    ids=["packing", "padding_free", "assistant_only_loss", "trl-collator", "max_length-smaller",
         "max_length-larger", "collator-max_length", "unknown-format", "skip_prepare-unpacked", "max_length-None",
         "prompt-only", "rows-longer-than-max_length", "empty-documents", "empty-or-untrained-documents",
         "packed-to-no-rows", "dataset-dict"],
)
def test_packed_sft_trainer_refusals(tmp_path, tokenizer, config, collator, dataset, error, match):
    empty = {"input_ids": [[], []]}  # Arrow types all-empty lists `list<null>`, labels too once TRL builds them
    train_dataset = {"unpacked": documents, "trl": trl_packed_rows, "questions": lambda: Dataset.from_dict(
        {"question": ["Why?"]}), "prompt-only": lambda: Dataset.from_dict({"prompt": ["Why?"]}),
        "empty": lambda: Dataset.from_dict(empty), "packed-empty": lambda: pack_dataset(Dataset.from_dict(empty), 32),
        "empty-or-untrained": lambda: Dataset.from_dict({"input_ids": [[], [5, 6]], "labels": [[], [-100, -100]]}),
        "splits": lambda: DatasetDict({"test": documents([3]), "train": documents()}),
    }.get(dataset, packed_rows)()
    output_dir = tmp_path / "out"
    with pytest.raises(error, match=match):
        PackedSFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(output_dir), **{**QUIET, **config}),
                         data_collator=collator, train_dataset=train_dataset, processing_class=tokenizer)
    assert not output_dir.exists()  # refused before anything is written


def test_eval_dataset_max_length_must_agree(tmp_path, tokenizer):
    expected = r"pack_dataset \(train_dataset\) 32, pack_dataset \(eval_dataset\) 16"
    with pytest.raises(PackingValueError, match=expected):
        PackedSFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path), **QUIET),
                         train_dataset=pack_dataset(documents(), MAX_LENGTH),
                         eval_dataset=pack_dataset(documents([3, 4]), 16), processing_class=tokenizer)


def test_refusal_after_trainer_init_leaves_no_output_folder(tmp_path, tokenizer, monkeypatch):
    def contaminated(model, **options):
        raise ContaminationError("documents attend across boundaries")

    monkeypatch.setattr("llm_packing.hook.verify.verify_packing", contaminated)
    output_dir = tmp_path / "out"
    with pytest.raises(ContaminationError):
        PackedSFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(output_dir), **QUIET),
                         train_dataset=pack_dataset(documents(), MAX_LENGTH), processing_class=tokenizer)
    assert not output_dir.exists()


def test_rows_of_one_document_need_no_hook(tmp_path, tokenizer):
    from llm_packing import is_packing_configured

    PackedSFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path), **QUIET),
                     train_dataset=pack_dataset(documents(), MAX_LENGTH, max_docs_per_bin=1),
                     processing_class=tokenizer)
    assert not is_packing_configured()


# -- what a packed dataset remembers -----------------------------------------------------------------------------


def test_packed_max_length_survives_the_usual_dataset_operations(tmp_path):
    packed = pack_dataset(documents(), MAX_LENGTH)
    packed.save_to_disk(str(tmp_path / "packed"))
    reloaded = load_from_disk(str(tmp_path / "packed"))
    for dataset in (packed, reloaded, reloaded.select([0]), reloaded.shuffle(seed=0), reloaded.with_format("torch"),
                    reloaded.select_columns(["input_ids", "seq_lengths"]), reloaded.filter(lambda row: True)):
        assert packed_max_length(dataset) == MAX_LENGTH
    assert packed_max_length(documents()) is None
    assert packed_max_length(pack_dataset(documents().to_iterable_dataset(), 40)) == 40



@pytest.mark.slow
def test_stock_trl_wrapped_packing_hides_the_documents_from_our_collator(tmp_path, tokenizer):
    # TRL re-packs our rows with `wrapped` (no `seq_lengths`): the collator sees each new row as one document.
    packed = pack_dataset(documents(), MAX_LENGTH)
    args = SFTConfig(output_dir=str(tmp_path), packing=True, packing_strategy="wrapped", max_length=MAX_LENGTH,
                     remove_unused_columns=False, **QUIET)
    trainer = SFTTrainer(model=configure_packing(tiny_model()), args=args, train_dataset=packed,
                         processing_class=tokenizer, data_collator=DataCollatorWithPacking())
    assert "seq_lengths" not in trainer.train_dataset.column_names
    assert int(first_batch(trainer)["attention_mask"].max()) == 1  # several documents per row, one attention span


# -- a plain transformers.Trainer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("keeps_columns", [True, False])
def test_plain_trainer_with_its_defaults_collates_the_documents_of_packed_rows(tmp_path, keeps_columns, monkeypatch):
    """`transformers.Trainer` drops the dataset columns its model's `forward` does not name (`remove_unused_columns`
    is on by default). While packing is configured it keeps `seq_lengths`, so `DataCollatorWithPacking` gets each
    row's documents. Control (`keeps_columns=False`, the patch undone): the rows arrive whole, as one document each."""
    from transformers import Trainer, TrainingArguments

    from llm_packing.hook import trainer_columns

    if not keeps_columns:
        monkeypatch.setattr(trainer_columns, "keep_packing_columns", lambda **options: None)
    model = tiny_model()
    configure_packing(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, **QUIET)
    trainer = Trainer(model=model, args=args, train_dataset=packed_rows(), data_collator=DataCollatorWithPacking())
    documents_per_row = [int(row.max()) for batch in trainer.get_train_dataloader() for row in batch["attention_mask"]]
    packed_documents = [len(row) for row in packed_rows()["seq_lengths"]]
    assert max(packed_documents) > 1
    expected = packed_documents if keeps_columns else [1] * len(packed_documents)
    assert sorted(documents_per_row) == sorted(expected)


@pytest.mark.parametrize("padding_free", [False, True])
def test_plain_trainer_keeps_the_columns_for_the_collator_of_an_unconfigured_model(tmp_path, padding_free):
    """`configure_packing` forgotten, `Trainer`'s defaults: building `DataCollatorWithPacking` keeps `seq_lengths` (it
    used to be dropped, and each packed row trained as one document, silently), so the collator refuses the packed
    rows; with `padding_free=True`, meant for an unconfigured model, it restarts positions per document. Building it
    does not make packing configured; `unconfigure_packing` keeps the columns while the collator lives, and restores
    `Trainer` once it is gone."""
    from transformers import Trainer, TrainingArguments

    original = Trainer._set_signature_columns_if_needed
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, **QUIET)
    collator = DataCollatorWithPacking(padding_free=padding_free)
    assert not is_packing_configured()
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=packed_rows(), data_collator=collator)
    if not padding_free:
        with pytest.raises(ContaminationError, match="the model hook is not applied"):
            next(iter(trainer.get_train_dataloader()))
    else:
        positions = torch.cat([batch["position_ids"][0] for batch in trainer.get_train_dataloader()])
        assert int((positions == 0).sum()) == sum(len(row) for row in packed_rows()["seq_lengths"])
    unconfigure_packing()
    assert Trainer._set_signature_columns_if_needed is not original
    del trainer, collator
    gc.collect()
    unconfigure_packing()
    assert Trainer._set_signature_columns_if_needed is original


def test_unconfiguring_keeps_the_columns_for_a_collator_still_alive(tmp_path):
    """A collator built, then packing configured and undone around it (`packing_configured`): `unconfigure_packing`
    undoes the column patch with the rest, then keeps it again for the live collator, which refuses the packed rows
    of the unconfigured model (each row trained as one document, silently, before)."""
    from transformers import Trainer, TrainingArguments

    collator = DataCollatorWithPacking()
    with packing_configured(tiny_model()):
        pass
    assert not is_packing_configured()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, **QUIET)
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=packed_rows(), data_collator=collator)
    with pytest.raises(ContaminationError, match="the model hook is not applied"):
        next(iter(trainer.get_train_dataloader()))


def test_a_trainer_imported_after_configuring_keeps_the_columns_through_the_collator(monkeypatch):
    """`configure_packing` patches `Trainer` where `transformers.trainer` is imported already (importing it costs
    about a second); a `DataCollatorWithPacking` built later, while packing is configured, patches it then."""
    import sys

    from transformers import trainer

    original = trainer.Trainer._set_signature_columns_if_needed
    monkeypatch.delitem(sys.modules, "transformers.trainer")
    configure_packing(tiny_model())
    assert trainer.Trainer._set_signature_columns_if_needed is original
    monkeypatch.setitem(sys.modules, "transformers.trainer", trainer)
    DataCollatorWithPacking()
    assert trainer.Trainer._set_signature_columns_if_needed is not original
    unconfigure_packing()
    assert trainer.Trainer._set_signature_columns_if_needed is original


IMPORTED_AFTER_CONFIGURING = """
import sys
sys.path.insert(0, {tests!r})
from tiny_models import tiny_model
from llm_packing import configure_packing, unconfigure_packing
from llm_packing.hook.registry import is_ours
configure_packing(tiny_model("llama"))
assert "transformers.trainer" not in sys.modules
from transformers import Trainer
print("patched", is_ours(Trainer._set_signature_columns_if_needed))
unconfigure_packing()
print("restored", not is_ours(Trainer._set_signature_columns_if_needed))
print("finders", sum(type(finder).__name__ == "_PatchOnImport" for finder in sys.meta_path))
"""


def test_a_trainer_first_imported_after_configuring_keeps_the_columns():
    """The order of a notebook: `configure_packing`, then `from transformers import Trainer`. `Trainer` is patched as
    its module is imported, and restored, with the import finder removed, by `unconfigure_packing` (in a fresh
    interpreter: here `transformers.trainer` is imported already)."""
    import os
    import subprocess
    import sys

    script = IMPORTED_AFTER_CONFIGURING.format(tests=os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.split(" ")[0] in ("patched", "restored", "finders")]
    assert lines == ["patched True", "restored True", "finders 0"]


@pytest.mark.parametrize("refused", [True, False])
def test_transformers_flattening_collator_refuses_packed_rows(refused, monkeypatch):
    """transformers' `DataCollatorWithFlattening` takes each `pack_dataset` row as one sequence; its restarting
    `position_ids` pass the model's guard. While packing is configured it refuses rows with `seq_lengths` (unpacked
    examples are its own job). Control (`refused=False`, the patch undone): the second document of a row attends to
    the first."""
    from transformers import DataCollatorWithFlattening

    from llm_packing.hook import trainer_columns

    if not refused:
        monkeypatch.setattr(trainer_columns, "refuse_packed_rows_in_flattening_collator", lambda: None)
    model = configure_packing(tiny_model()).eval()
    row = next(row for row in packed_rows() if len(row["seq_lengths"]) > 1)
    DataCollatorWithFlattening()([{"input_ids": row["input_ids"]}])
    if refused:
        with pytest.raises(ContaminationError, match="`DataCollatorWithFlattening` got rows with `seq_lengths`"):
            DataCollatorWithFlattening()([row])
        return
    batch = DataCollatorWithFlattening()([row])
    first, second = row["seq_lengths"][:2]
    with torch.no_grad():
        flattened = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = model(input_ids=torch.tensor([row["input_ids"][first:first + second]])).logits[0]
    assert (flattened[first:first + second] - alone).abs().max() > 1e-3


def test_unconfigure_restores_the_trainers_columns(tmp_path):
    from transformers import Trainer

    original = Trainer._set_signature_columns_if_needed
    configure_packing(tiny_model())
    assert Trainer._set_signature_columns_if_needed is not original
    unconfigure_packing()
    assert Trainer._set_signature_columns_if_needed is original

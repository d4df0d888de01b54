"""The block-copy kernel's own input checks, called on ops._block_copy directly: the Python layer
refuses most bad input first, but the kernel's checks are its contract.  A check that fails open
writes out of bounds, so every call here runs in a child process and a crash fails the test
instead of killing pytest."""
import os
import subprocess
import sys
import textwrap

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_child(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"child exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_zero_layers_are_refused_not_copied_out_of_bounds():
    # 33+ ids take the bitmap path of the duplicate check, which with no layer used to index
    # a one-byte bitmap with ids near 2**40 (a segfault).
    out = run_child("""
        import numpy as np
        from ops import _block_copy
        none = np.zeros(0, dtype=np.int64)
        for count in (1, 40):
            ids = [2**40 + 8 * i for i in range(count)]
            try:
                _block_copy.copy_blocks(none, none, 64, ids, "src", none, none, 64, ids, "dst", 64, 1)
            except ValueError as exc:
                print("refused:", exc)
            else:
                print("copied")
    """).stdout
    assert out.splitlines() == ["refused: copy_blocks needs at least one layer (src and dst have 0)"] * 2


def test_capacity_whose_addresses_overflow_is_refused():
    out = run_child("""
        import numpy as np
        from ops import _block_copy
        buf = np.zeros(256, dtype=np.uint8)
        one = lambda v: np.array([v], dtype=np.int64)
        base = one(buf.ctypes.data)
        try:
            _block_copy.copy_blocks(base, one(2**62), 64, [2**61], "src", base, one(4), 64, [0], "dst", 64, 1)
        except ValueError as exc:
            print("refused:", exc)
    """).stdout
    assert "src capacity 4611686018427387904 of layer 0 times stride 64 overflows" in out


def test_duplicates_in_a_huge_cache_are_found_without_a_bitmap_over_it():
    # A destination of 2**30 one-byte blocks (sparse, untouched memory): a bitmap over it would be
    # 128 MiB; the kernel sorts the ids instead and still names the earliest repeat.
    out = run_child("""
        import mmap
        import numpy as np
        from ops import _block_copy
        cap = 2**30
        area = mmap.mmap(-1, cap, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        dst = np.frombuffer(area, dtype=np.uint8)
        src = np.arange(64, dtype=np.uint8)
        one = lambda v: np.array([v], dtype=np.int64)
        ids = [cap - 1 - 4096 * i for i in range(40)]
        n = _block_copy.copy_blocks(one(src.ctypes.data), one(64), 1, list(range(40)), "src",
                                    one(dst.ctypes.data), one(cap), 1, ids, "dst", 1, 1)
        print("copied", n, all(int(dst[d]) == s for s, d in enumerate(ids)))
        repeat = ids[:30] + [ids[7]] + ids[30:38] + [ids[3]]
        try:
            _block_copy.copy_blocks(one(src.ctypes.data), one(64), 1, list(range(40)), "src",
                                    one(dst.ctypes.data), one(cap), 1, repeat, "dst", 1, 1)
        except ValueError as exc:
            print("refused:", exc)
        del dst
        area.close()
    """).stdout.splitlines()
    assert out[0] == "copied 40 True"
    assert out[1] == f"refused: dst block id {2**30 - 1 - 4096 * 7} appears more than once (again at position 30)"


# ---------------------------------------------------------------- fuzzing, in a child process

BLOCK = 8


@st.composite
def kernel_call(draw):
    """Real buffers (caps tell the truth about them) and drawn ids: in range, huge, negative,
    repeated, of mismatched lengths, and sometimes no layer at all."""
    layers = draw(st.integers(0, 3))
    src_caps = draw(st.lists(st.integers(0, 40), min_size=layers, max_size=layers))
    dst_caps = draw(st.lists(st.integers(0, 40), min_size=layers, max_size=layers))
    any_id = st.one_of(st.integers(-3, 45), st.integers(-2**63, 2**63 - 1),
                       st.sampled_from([2**31, 2**32, 2**40, 2**62, -2**63, 2**63 - 1]))
    n = draw(st.integers(0, 70))
    src_ids = draw(st.lists(any_id, min_size=n, max_size=n))
    dst_ids = draw(st.lists(any_id, min_size=n, max_size=n))
    if draw(st.booleans()):  # mostly valid calls too, so exact copies get checked
        low = min(src_caps + dst_caps, default=0)
        k = min(n, low)
        src_ids = draw(st.permutations(range(low)))[:k] if low else []
        dst_ids = draw(st.permutations(range(low)))[:k] if low else []
        if k and draw(st.booleans()):
            dst_ids[-1] = dst_ids[0]
    if draw(st.booleans()):
        dst_ids = dst_ids + draw(st.lists(st.integers(0, 3), min_size=1, max_size=2))
    as_array = draw(st.booleans())
    return dict(src_caps=src_caps, dst_caps=dst_caps, src_ids=src_ids, dst_ids=dst_ids, as_array=as_array)


def expected_error(c) -> bool:
    if not c["src_caps"] or len(c["src_ids"]) != len(c["dst_ids"]):
        return True
    for ids, caps in ((c["src_ids"], c["src_caps"]), (c["dst_ids"], c["dst_caps"])):
        if any(not 0 <= i < min(caps) for i in ids):
            return True
    return len(set(c["dst_ids"])) != len(c["dst_ids"])


def check_one(c) -> None:
    from ops import _block_copy
    rng = np.random.default_rng(len(c["src_ids"]))
    srcs = [rng.integers(0, 256, cap * BLOCK + 1, dtype=np.uint8) for cap in c["src_caps"]]
    dsts = [rng.integers(0, 256, cap * BLOCK + 1, dtype=np.uint8) for cap in c["dst_caps"]]
    before = [d.copy() for d in dsts]
    bases = lambda bufs: np.array([b.ctypes.data for b in bufs], dtype=np.int64)  # noqa: E731
    caps = lambda v: np.array(v, dtype=np.int64)  # noqa: E731

    def ids(v):
        if not c["as_array"]:
            return list(v)
        try:
            return np.array(v, dtype=np.int64)
        except OverflowError:
            return list(v)

    try:
        _block_copy.copy_blocks(bases(srcs), caps(c["src_caps"]), BLOCK, ids(c["src_ids"]), "src",
                                bases(dsts), caps(c["dst_caps"]), BLOCK, ids(c["dst_ids"]), "dst",
                                BLOCK, 2)
    except ValueError:
        assert expected_error(c), f"refused a valid call {c}"
        assert all(np.array_equal(a, b) for a, b in zip(before, dsts)), "a refused call wrote bytes"
        return
    assert not expected_error(c), f"accepted a bad call {c}"
    for src, want, got in zip(srcs, before, dsts):
        for s, d in zip(c["src_ids"], c["dst_ids"]):
            want[d * BLOCK:(d + 1) * BLOCK] = src[s * BLOCK:(s + 1) * BLOCK]
        assert np.array_equal(want, got), "copied bytes differ from the reference"


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(c=kernel_call())
def fuzz_kernel_checks(c):
    check_one(c)


def test_fuzzed_ids_copy_exactly_or_raise_value_error_never_crash():
    out = run_child("""
        import tests.ops.test_block_copy_checks as t
        t.fuzz_kernel_checks()
        print("fuzzed")
    """, timeout=600)
    assert out.stdout.strip() == "fuzzed"

"""The GPU actor's kernels against the format's reference (dequantize_base then matmul) and the offline
Hadamard. The Triton kernel runs under TRITON_INTERPRET=1 in a subprocess (this file's __main__), because
the interpreter must be chosen before anything in the process imports triton."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

from splitspec.gpu_actor.kernels import BaseProduct, base_matmul, cpu_step, rotate_input, unrotate_output, warmup
from splitspec.gpu_actor.kernels.rotation import fast_hadamard
from splitspec.kernels import amx, cpu_base
from splitspec.kernels.cpu_base.arena import HUGE_PAGE, Arena
from splitspec.kernels.cpu_base.dense import dense_matmul
from splitspec.kernels.cpu_base.perm import BITALG
from splitspec.kernels.cpu_base.tiles import TILE_TOKENS
from splitspec.quantize import hadamard
from splitspec.quantize.activations import INT16_MAX, round_activations
from splitspec.quantize.format import GROUP, dequantize_base, pack_base_codes

ROWS = (1, 37, 960)
D_IN = (32, 576, 1536)
TOKENS = (1, 3, 16, 64)
LEVELS = torch.tensor([-1.51, -0.45, 0.45, 1.51])

# the fp32 paths (tables, decode + sgemm): x is not rounded, so they meet the fp32 reference
fp32_matmul = partial(base_matmul, tiled=False)
# the base's tiles take AVX512-BITALG too (every CPU with AMX has it)
needs_amx = pytest.mark.skipif(
    not (amx.enabled() and BITALG), reason="this CPU (or SPLITSPEC_AMX=0) gives no AMX tiles"
)


def make_base(
    rows: int, d_in: int, seed: int = 0, levels: torch.Tensor = LEVELS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4, (rows, d_in), generator=g, dtype=torch.uint8)
    scale = (torch.rand(rows, -(-d_in // GROUP), generator=g) * 0.1 + 1e-3).half()
    return pack_base_codes(codes), scale, dequantize_base(pack_base_codes(codes), scale, levels)


def assert_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 rounding: summation order differs from torch's, so compare relative to the largest output."""
    assert y.shape == ref.shape and y.dtype == torch.float32
    err = (y - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), err


def check_all_shapes(matmul: Callable[..., torch.Tensor], device: str, every_n: bool = True) -> None:
    """Every (rows, d_in); with every_n False, one token count per shape, rotating (the interpreter is slow)."""
    for i, (rows, d_in) in enumerate((r, d) for r in ROWS for d in D_IN):
        planes, scale, w = make_base(rows, d_in, seed=i)
        for n in TOKENS if every_n else (TOKENS[i % len(TOKENS)],):
            x = torch.randn(n, d_in, generator=torch.Generator().manual_seed(n))
            y = matmul(planes.to(device), scale.to(device), LEVELS.to(device), x.to(device))
            assert_matches(y.cpu(), x @ w.T)


def test_cpu_base_matches_reference() -> None:
    check_all_shapes(fp32_matmul, "cpu")


# Levels the kernel's bilinear form handles differently: exactly symmetric (two planes' sums), not quite
# symmetric (adds the sums over ~(b0 ^ b1)), and off-centre (adds the Σx term too).
KINDS_OF_LEVELS = {
    "symmetric": LEVELS,
    "asymmetric": torch.tensor([-1.6, -0.4, 0.5, 1.45]),
    "off-centre": torch.tensor([-0.3, 0.7, 1.2, 2.9]),
}


@pytest.mark.parametrize("kind", KINDS_OF_LEVELS)
@pytest.mark.parametrize(("rows", "d_in"), [(37, 96), (13, 32), (61, 576), (9, 160), (100, 1536)])
def test_cpu_base_every_token_count(kind: str, rows: int, d_in: int) -> None:
    """n = 1 .. 65 covers both kinds of table (the few-token ones, two tokens at a time on AVX2 or four on
    AVX-512, and the byte tables' blocks: of 8 tokens on AVX2, the last one padded, of 16 on AVX-512 with
    the tokens left over on the few-token tables); row counts not a multiple of the row blocks (32 rows on
    AVX2, 16 on AVX-512, whose spare rows take the byte tables) end in a part block;
    d_in = 32, 96 and 160 end in a group shorter than 128 columns, alone (32, 96) or after a whole one
    (160), and 1536 has twelve groups."""
    levels = KINDS_OF_LEVELS[kind]
    planes, scale, w = make_base(rows, d_in, seed=rows, levels=levels)
    for n in range(1, 66):
        x = torch.randn(n, d_in, generator=torch.Generator().manual_seed(n))
        assert_matches(fp32_matmul(planes, scale, levels, x), x @ w.T)


@pytest.mark.parametrize("kind", KINDS_OF_LEVELS)
@pytest.mark.parametrize(("rows", "d_in"), [(13, 32), (37, 160), (960, 1536)])
def test_cpu_base_many_tokens(kind: str, rows: int, d_in: int) -> None:
    """Many tokens, whichever way the host takes them (on AVX-512 byte tables of 16-token blocks, 131's last
    3 tokens on the few-token tables; on AVX2 decode + sgemm from DENSE_TOKENS), and the decode + sgemm on
    any host: a tile of rows at a time, 960 × 1536 in several tiles, 160 ending in a short group; into a
    column slice of a wider buffer too."""
    levels = KINDS_OF_LEVELS[kind]
    planes, scale, w = make_base(rows, d_in, seed=rows, levels=levels)
    decoded = partial(dense_matmul, planes, scale, levels)
    for n in (128, 131):
        x = torch.randn(n, d_in, generator=torch.Generator().manual_seed(n))
        assert_matches(fp32_matmul(planes, scale, levels, x), x @ w.T)
        y = torch.empty(n, rows)
        decoded(x, y)
        assert_matches(y, x @ w.T)
        buf = torch.full((n, rows + 9), 7.0)
        out = fp32_matmul(planes, scale, levels, x, out=buf[:, 4 : 4 + rows])
        assert out.data_ptr() == buf[:, 4:].data_ptr()
        assert_matches(buf[:, 4 : 4 + rows], x @ w.T)
        assert (buf[:, :4] == 7).all() and (buf[:, 4 + rows :] == 7).all()
        buf = torch.full((n, rows + 9), 7.0)
        decoded(x, buf[:, 4 : 4 + rows])
        assert_matches(buf[:, 4 : 4 + rows], x @ w.T)
        assert (buf[:, :4] == 7).all() and (buf[:, 4 + rows :] == 7).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS_OF_LEVELS)
def test_cpu_base_threads_split_rows(threads: int, kind: str) -> None:
    """With more than one thread, each takes whole row blocks of its own (the last share ends the rows); 600
    rows are 38 blocks of 16, in tiles of 16 blocks (``perm.TILE``), so two threads' shares part mid-tile."""
    levels = KINDS_OF_LEVELS[kind]
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for rows, d_in in ((203, 416), (600, 576)):
            planes, scale, w = make_base(rows, d_in, levels=levels)
            for n in (1, 3, 4, 8, 17):
                x = torch.randn(n, d_in, generator=torch.Generator().manual_seed(n))
                assert_matches(fp32_matmul(planes, scale, levels, x), x @ w.T)
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS_OF_LEVELS)
def test_cpu_base_split_by_code_words_adds_up_to_the_whole(threads: int, kind: str) -> None:
    """A prompt's base split by code words (``EngineConfig.base_share``): the engine's first ``split`` words
    of every row (``BaseProduct``'s ``split``) and the CPU actors' rest (``ShareProduct``, which keeps the
    codes from the split's scale group on) each match the dequantized reference over their columns, at a
    split inside a group and on a group's edge, for token counts that end in a part block of the byte
    tables; threads share the rows."""
    levels = KINDS_OF_LEVELS[kind]
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for rows, d_in, splits in ((203, 576, (15, 16, 1)), (130, 1536, (40, 47)), (37, 160, (2, 4))):
            planes, scale, w = make_base(rows, d_in, seed=rows, levels=levels)
            product = BaseProduct(planes, scale, levels, tiled=False)
            for split in splits:
                share = cpu_base.ShareProduct(planes, scale, levels, split)
                c = split * 32
                for n in (1, 5, 16, 37):
                    x = torch.randn(n, d_in, generator=torch.Generator().manual_seed(n))
                    assert_matches(product(x, split=split), x[:, :c] @ w[:, :c].T)
                    assert_matches(torch.from_numpy(share(x.numpy())), x[:, c:] @ w[:, c:].T)
    finally:
        numba.set_num_threads(before)
    with pytest.raises(ValueError, match="starts at one of the row's 5 code words"):
        cpu_base.ShareProduct(planes, scale, levels, 5)
    with pytest.raises(ValueError, match="a split of the base's 5 code words"):
        product(x, split=6)


# an AVX2 CPU's features (Zen 3's vector ones): numba takes the host's with a CPU name alone
AVX2_FEATURES = (
    "+64bit,+avx,+avx2,+bmi,+bmi2,+cx16,+f16c,+fma,+lzcnt,+movbe,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3"
)


@pytest.mark.skipif(not cpu_base.WIDE, reason="without AVX-512 the tests above run the AVX2 kernel already")
def test_cpu_base_avx2_kernel_on_an_avx512_host(tmp_path) -> None:
    """Compiled for Zen 3 (NUMBA_CPU_NAME and its features, into a cache of its own), the kernel keeps to
    AVX2, and no AVX-512 or AMX intrinsic is compiled (LLVM aborts on one for this CPU): the checks above in
    a subprocess."""
    cpu = {"NUMBA_CPU_NAME": "znver3", "NUMBA_CPU_FEATURES": AVX2_FEATURES, "NUMBA_CACHE_DIR": str(tmp_path)}
    env = {**os.environ, **cpu}
    done = subprocess.run([sys.executable, __file__, "avx2"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr


def test_numba_cache_follows_the_kernel_sources(tmp_path) -> None:
    """Importing splitspec points numba's cache at SPLITSPEC_CACHE/numba/<hash of every kernel source>, so
    that an edit to an intrinsic inlined from another module (which numba's own check misses) compiles
    anew; a NUMBA_CACHE_DIR the user set stands."""
    import shutil

    import splitspec

    def folder(
        package_parent: Path, code: str = "import os, splitspec; print(os.environ['NUMBA_CACHE_DIR'])", **extra: str
    ) -> str:
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
        env |= {"SPLITSPEC_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(package_parent), **extra}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()

    source = Path(splitspec.__file__).parent
    copy = tmp_path / "src"
    shutil.copytree(source, copy / "splitspec", ignore=shutil.ignore_patterns("__pycache__"))
    first = Path(folder(copy))
    assert first.parent == tmp_path / "cache" / "numba" and len(first.name) == 16 and first.is_dir()
    assert Path(folder(copy)) == first
    # numba imported first, its threads started on two CPUs, then narrowed to one: the same folder, no error
    late = (
        "import os, numba; numba.get_num_threads(); os.sched_setaffinity(0, {0}); import splitspec; "
        "numba.njit(lambda: 1)(); print(numba.config.CACHE_DIR)"
    )
    assert Path(folder(copy, late)) == first
    with open(copy / "splitspec" / "kernels" / "cpu_base" / "nibbles.py", "a") as f:
        f.write("# an edit\n")
    edited = Path(folder(copy))
    assert edited.parent == first.parent and edited != first
    assert folder(copy, NUMBA_CACHE_DIR=str(tmp_path / "mine")) == str(tmp_path / "mine")


@pytest.mark.parametrize(("rows", "n"), [(0, 1), (0, 20), (37, 0)])
def test_cpu_base_empty_products(rows: int, n: int) -> None:
    planes, scale, _ = make_base(rows, 576)
    assert base_matmul(planes, scale, LEVELS, torch.randn(n, 576)).shape == (n, rows)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_cpu_base_arena_copies_onto_regions_advised_for_huge_pages() -> None:
    """The laid-out codes' arena: exact copies, each on its own cache lines, in regions that start on a
    2 MiB boundary and that Linux has marked for huge pages; a tensor larger than a region gets its own."""
    arena = Arena(region_bytes=4 << 20)
    sources = [
        torch.randn(1000),
        torch.arange(77, dtype=torch.int16),
        torch.randint(-(2**31), 2**31 - 1, (3000, 5), dtype=torch.int32),
        torch.empty(0, 3),
        torch.ones(7 << 20, dtype=torch.uint8),  # more than a region and its alignment slack
    ]
    copies = [arena.copy(t) for t in sources]
    for source, copy in zip(sources, copies, strict=True):
        assert copy.dtype == source.dtype and copy.shape == source.shape and torch.equal(copy, source)
        assert copy.is_contiguous() and copy.data_ptr() % 64 == 0
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies if c.numel())
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert copies[-1].data_ptr() % HUGE_PAGE == 0
    if _huge_pages_advisable():
        assert "hg" in _vm_flags(copies[0].data_ptr()) and "hg" in _vm_flags(copies[-1].data_ptr())
    with pytest.raises(ValueError, match="region_bytes"):
        Arena(region_bytes=0)


def _huge_pages_advisable() -> bool:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return sys.platform == "linux" and thp.exists() and "[never]" not in thp.read_text()


def test_cpu_base_lays_its_codes_out_in_the_shared_arena() -> None:
    planes, scale, w = make_base(37, 576)
    product = cpu_base.Product(planes, scale, LEVELS)
    for laid in product.buffers[-2:]:  # the laid-out codes and block scales
        assert laid.data_ptr() % 64 == 0
        assert not _huge_pages_advisable() or "hg" in _vm_flags(laid.data_ptr())
    x = torch.randn(3, 576)
    assert_matches(product(x), x @ w.T)


def test_cpu_base_byte_tables_are_each_python_threads_own_on_huge_pages() -> None:
    """The byte tables' scratch: on a 2 MiB boundary of memory marked for huge pages, the same for a thread's
    calls (grown when more numba threads ask), another thread's its own; long products run from a pool of
    two Python threads match the reference."""
    from concurrent.futures import ThreadPoolExecutor

    from splitspec.kernels.cpu_base.kernel import table_scratch
    from splitspec.kernels.cpu_base.rows import TABLE_FLOATS

    at = table_scratch(1)
    assert at % HUGE_PAGE == 0 and table_scratch(1) == at
    assert not _huge_pages_advisable() or "hg" in _vm_flags(at)
    with ThreadPoolExecutor(2) as pool:
        others = list(pool.map(lambda _: table_scratch(1), range(2)))
    assert at not in others
    more = HUGE_PAGE // (4 * TABLE_FLOATS) + 1  # more numba threads' tables than one 2 MiB page holds
    assert table_scratch(more) % HUGE_PAGE == 0 and table_scratch(1) == table_scratch(more)
    planes, scale, w = make_base(300, 576, seed=5)
    product = cpu_base.Product(planes, scale, LEVELS)
    xs = [torch.randn(96, 576, generator=torch.Generator().manual_seed(k)) for k in range(8)]
    with ThreadPoolExecutor(2) as pool:
        ys = list(pool.map(product, xs))
    for x, y in zip(xs, ys, strict=True):
        assert_matches(y, x @ w.T)


def test_cpu_base_writes_into_a_column_slice() -> None:
    planes, scale, w = make_base(37, 576)
    x = torch.randn(5, 576)
    buf = torch.full((5, 100), 7.0)
    out = base_matmul(planes, scale, LEVELS, x, out=buf[:, 10:47])
    assert out.data_ptr() == buf[:, 10:47].data_ptr()
    assert_matches(buf[:, 10:47], x @ w.T)
    assert (buf[:, :10] == 7).all() and (buf[:, 47:] == 7).all()


def test_cpu_base_upcasts_activations() -> None:
    planes, scale, w = make_base(37, 576)
    x = torch.randn(3, 576).to(torch.bfloat16)
    assert_matches(base_matmul(planes, scale, LEVELS, x), x.float() @ w.T)


@pytest.mark.parametrize(
    ("codes", "scale", "x"),
    [
        ((4, 18, 2), (4, 5), (1, 512)),  # x narrower than the codes
        ((4, 18, 2), (4, 4), (1, 576)),  # a 128-group without its scale
        ((4, 18, 1), (4, 5), (1, 576)),  # one bit plane
        ((4, 18, 2), (4, 5), (576,)),  # a vector, not [n, d_in]
    ],
)
def test_shape_mismatch_is_refused(codes: tuple, scale: tuple, x: tuple) -> None:
    with pytest.raises(ValueError):
        base_matmul(torch.zeros(codes, dtype=torch.int32), torch.ones(scale).half(), LEVELS, torch.zeros(x))


def test_wrong_output_buffer_is_refused() -> None:
    planes, scale, _ = make_base(37, 576)
    for out in (torch.zeros(2, 37), torch.zeros(1, 37, dtype=torch.float64), torch.zeros(37, 2).T[:1]):
        with pytest.raises(ValueError):
            base_matmul(planes, scale, LEVELS, torch.zeros(1, 576), out=out)


def test_bound_product_serves_many_calls() -> None:
    """A model binds one ``BaseProduct`` per matrix and calls it every pass: the same object gives the
    reference at every token count (tables, byte tables, decode + sgemm), fp16 activations upcast, and still
    refuses an input of the wrong width or a wrong buffer after its matrix was checked."""
    planes, scale, w = make_base(61, 576, seed=3)
    product = BaseProduct(planes, scale, LEVELS.double(), tiled=False)  # levels of another dtype bound as fp32
    for n in (1, 4, 17, 131, 2, 1):
        x = torch.randn(n, 576, generator=torch.Generator().manual_seed(n))
        assert_matches(product(x), x @ w.T)
    x = torch.randn(3, 576, dtype=torch.float16)
    assert_matches(product(x), x.float() @ w.T)
    with pytest.raises(ValueError, match=r"x must be \[n, 576\]"):
        product(torch.zeros(1, 544))
    with pytest.raises(ValueError, match="out must be float32"):
        product(torch.zeros(2, 576), out=torch.zeros(1, 61))
    with pytest.raises(ValueError, match="scale must be float16"):
        BaseProduct(planes, scale.float(), LEVELS)


@needs_amx
@pytest.mark.parametrize(("rows", "d_in"), [(13, 32), (37, 160), (61, 576), (960, 1536), (40, 4160)])
def test_cpu_base_tiles_take_x_rounded_to_int16(rows: int, d_in: int) -> None:
    """On AMX tiles (from TILE_TOKENS tokens) the product is x rounded to int16 codes per 128 columns (the
    residual's rounding, ``round_activations``) times the base, to fp32's order of additions, and so within
    that rounding's own bound of the fp32 product. Row counts that end in a part tile of 16, short last
    groups (32, 160, 4160), token counts that end in a part tile, and (256 tokens × 4160 columns) blocks of
    groups, whose sums wait in the output between blocks."""
    planes, scale, w = make_base(rows, d_in, seed=rows)
    for n in (TILE_TOKENS, TILE_TOKENS + 5, 256):
        x = torch.randn(n, d_in, generator=torch.Generator().manual_seed(n))
        y = base_matmul(planes, scale, LEVELS, x, tiled=True)
        assert_matches(y, round_activations(x) @ w.T)
        ref = x @ w.T
        bound = x.abs().max() / (2 * INT16_MAX) * w.abs().sum(1).max() + 1e-5 * ref.abs().max()
        assert (y - ref).abs().max() <= bound
        assert (y - ref).abs().max() > 1e-6 * ref.abs().max()  # x was rounded: not the fp32 product


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_base_tiles_split_rows_and_fill_a_column_slice(threads: int) -> None:
    planes, scale, w = make_base(203, 416)
    x = torch.randn(45, 416, generator=torch.Generator().manual_seed(1))
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        buf = torch.full((45, 210), 7.0)
        out = base_matmul(planes, scale, LEVELS, x, out=buf[:, 3:206], tiled=True)
    finally:
        numba.set_num_threads(before)
    assert out.data_ptr() == buf[:, 3:].data_ptr()
    assert_matches(buf[:, 3:206], round_activations(x) @ w.T)
    assert (buf[:, :3] == 7).all() and (buf[:, 206:] == 7).all()


def test_cpu_base_tiles_only_for_symmetric_levels() -> None:
    """The tiles sum the two sign planes only (c0 = c3 = 0): other levels keep the fp32 paths by default,
    and asking for tiles with them, or where the CPU has none, is refused."""
    planes, scale, w = make_base(37, 160, levels=KINDS_OF_LEVELS["asymmetric"])
    assert not cpu_base.Product(planes, scale, KINDS_OF_LEVELS["asymmetric"]).tiled
    assert cpu_base.Product(planes, scale, LEVELS).tiled == (amx.enabled() and BITALG)
    with pytest.raises(ValueError, match="symmetric levels"):
        cpu_base.Product(planes, scale, KINDS_OF_LEVELS["asymmetric"], tiled=True)
    x = torch.randn(TILE_TOKENS, 160)
    assert_matches(base_matmul(planes, scale, KINDS_OF_LEVELS["asymmetric"], x), x @ w.T)


def test_warmup_reports_seconds() -> None:
    assert warmup() >= 0.0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_base_matches_reference_interpreted() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("kind", hadamard.ROTATIONS)
@pytest.mark.parametrize("d", [576, 192, 1536, 4096])
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 3)])
def test_rotation_matches_offline_hadamard(kind: str, d: int, lead: tuple[int, ...]) -> None:
    x = torch.randn(*lead, d, generator=torch.Generator().manual_seed(d))
    s = hadamard.random_signs(d, d)
    for fast, ref in ((rotate_input, hadamard.rotate_input), (unrotate_output, hadamard.unrotate_output)):
        want = ref(x, s, kind)
        got = fast(x, s, kind)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_kron_plans_take_the_fewest_multiply_adds() -> None:
    """The Sylvester part as wide as ``kron``'s butterflies go, and a lone Paley II factor by its conference
    matrix: what ``test_rotation_rows_on_the_cpu_match_the_reference`` then checks against the reference."""
    from splitspec.gpu_actor.kernels.rotation import _kron_plan

    assert _kron_plan(576, "kronecker") == ((("paley", 36),), 36, 16, True)  # Paley II, q = 17
    assert _kron_plan(192, "kronecker") == ((("paley", 12),), 12, 16, False)  # Paley I, q = 11
    assert _kron_plan(1536, "kronecker") == ((("paley", 12),), 12, 128, False)
    assert _kron_plan(14336, "kronecker") == ((("paley", 28), ("sylvester", 4)), 112, 128, False)
    assert _kron_plan(4096, "sylvester") == ((("sylvester", 32),), 32, 128, False)
    assert _kron_plan(576, "sylvester") == ((), 1, 64, False)
    assert _kron_plan(12 * 8192, "kronecker") is None  # F1 would be 768 wide: the matmuls instead


@pytest.mark.parametrize("kind", hadamard.ROTATIONS)
@pytest.mark.parametrize("d", [192, 576, 1536, 4096])
def test_rotation_rows_on_the_cpu_match_the_reference(kind: str, d: int) -> None:
    """fp32 rows on the CPU, a decode step's few or a prompt's hundreds, take the ``kron`` kernel, on a
    whole tensor, a slice of columns or a stack of Linears' outputs ([n, count, d] of a slice), signs on
    either side, and ``add_to``, and agree with the offline transform in float64 (the last factor, 16 to
    128 wide, by butterflies; 576's Paley II factor by pairs of rows)."""
    from splitspec.gpu_actor.kernels.rotation import Rotation

    gen = torch.Generator().manual_seed(d)
    for transpose in (False, True):
        signs = torch.stack([hadamard.random_signs(seed, d) for seed in (1, 2)])
        for count in (1, 2):
            rot = Rotation(d, kind, transpose, signs[0] if count == 1 else signs)
            assert rot._kron is not None
            for n in (1, 5, 64, 257):
                wide = torch.randn(n, count * d + 9, generator=gen)
                x = wide[:, 4 : 4 + count * d].view(n, count, d).squeeze(1)
                assert rot._kron_layout(x) is not None
                x64 = x.double().reshape(n, count, d)
                s64 = signs[:count].double()
                want = hadamard.hadamard(x64, kind, True) * s64 if transpose else hadamard.hadamard(x64 * s64, kind)
                want = want.reshape(x.shape).float()
                got = rot(x)
                assert got.shape == x.shape and got.is_contiguous()
                torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * want.abs().max().item())
                acc = torch.randn(x.shape, generator=gen)
                torch.testing.assert_close(
                    rot.add_to(acc.clone(), x), acc + want, rtol=0, atol=1e-5 * want.abs().max().item()
                )


@pytest.mark.parametrize("kind", hadamard.ROTATIONS)
@pytest.mark.parametrize("d", [1, 3, 2, 64, 128, 576, 1536, 2048, 4096, 5376, 8192, 14336, 15360, 368, 12 * 8192])
def test_fast_hadamard_is_the_same_transform(kind: str, d: int) -> None:
    """In float64 the rounding vanishes and only the algorithm is compared: every block-size regime, the
    merged Paley ⊗ Sylvester factor (1536, 14336), a Sylvester part split in three (12·8192), the
    fallback (368 = 16·23), and the inverse (the Paley factor is not symmetric)."""
    x = torch.randn(4, d, dtype=torch.float64)
    for transpose in (False, True):
        want = hadamard.hadamard(x, kind, transpose)
        torch.testing.assert_close(fast_hadamard(x, kind, transpose), want, rtol=0, atol=1e-12)


def test_fast_hadamard_returns_a_new_tensor_at_width_one() -> None:
    x = torch.randn(3, 1)
    assert fast_hadamard(x, "kronecker").data_ptr() != x.data_ptr()


def _check_avx2_kernel() -> None:
    from splitspec.kernels.cpu_base import kernel

    assert not cpu_base.WIDE, "run by test_cpu_base_avx2_kernel_on_an_avx512_host, with NUMBA_CPU_NAME set"
    assert not kernel.TILES, "the tile loops would be compiled for a CPU without AMX"
    test_cpu_base_matches_reference()
    for kind in KINDS_OF_LEVELS:
        for rows, d_in in ((37, 96), (13, 32), (61, 576), (9, 160)):
            test_cpu_base_every_token_count(kind, rows, d_in)
        for threads in (1, 2):
            test_cpu_base_threads_split_rows(threads, kind)
        test_cpu_base_split_by_code_words_adds_up_to_the_whole(1, kind)
    for d in (576, 1536):  # a Paley II factor's pairs; 128-wide butterflies, F1 in halves of 64
        test_rotation_rows_on_the_cpu_match_the_reference("kronecker", d)
    for n, window in ((3, 0), (25, 0), (25, 12)):  # the softmax's 16-lane max
        test_the_compiled_attention_matches_sdpa(64, 3, 0.0, False, n, window)


def test_the_compiled_exp_is_within_a_few_ulp_of_exp() -> None:
    """``cpu_step``'s vectorizable e^x (attention's softmax) against float64 exp, over the whole range it takes
    (x ≤ 0, down to where e^x leaves the normal floats)."""
    from splitspec.gpu_actor.kernels.cpu_step import _exp

    @numba.njit
    def exp_all(x, out):
        for i in range(x.shape[0]):
            out[i] = _exp(x[i])

    x = np.concatenate([np.linspace(-87, 0, 100_001), [-1e-30, 0.0]]).astype(np.float32)
    out = np.empty_like(x)
    exp_all(x, out)
    exact = np.exp(x.astype(np.float64))
    assert (np.abs(out - exact) / exact).max() < 8 * 2.0**-24  # a few ulp
    assert out[-1] == 1.0


@pytest.mark.parametrize("gelu", [False, True])
def test_the_compiled_activations_match_torchs(gelu: bool) -> None:
    """``cpu_step``'s gated MLP activation (SiLU, GELU's tanh form, both through its exp) against torch's."""
    from splitspec.gpu_actor.kernels.cpu_step import activate

    gate = torch.linspace(-30, 30, 6000).reshape(3, -1)
    up = torch.randn_like(gate)
    out = torch.empty_like(gate)
    activate(torch.cat((gate, up), dim=1).numpy(), gelu, out.numpy())
    act = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(gate)
    torch.testing.assert_close(out, act * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize(
    ("per_kv", "cap", "by_row", "n", "window"),
    [
        *((k, 0.0, False, 3, 0) for k in (1, 2, 3, 5, 6, 7)),
        (2, 1.5, False, 3, 0),
        (2, 0.0, True, 3, 0),
        *((k, 0.0, False, 25, 12) for k in (1, 3)),
        (2, 1.5, True, 25, 12),
        (3, 0.0, False, 25, 0),
    ],
)
def test_the_compiled_attention_matches_sdpa(
    d: int, per_kv: int, cap: float, by_row: bool, n: int, window: int
) -> None:
    """``cpu_step.attention`` (each head size's copy, query heads per kv head taking every width of its value
    sums; soft-capped scores; q scaled by row) against RoPE then attention written out with the same mask, K
    and V written into the cache slots after ``start``. Three rows of a tree's check (random visibility)
    take one dot product a slot; 25 rows, blocks of scores (``BLOCKED_QUERIES`` query vectors on, the
    last group short), are causal (every slot up to a row's own: no mask to apply) or look through a window
    (a sliding layer's), so that no row sees the first blocks of slots and each row's last slot is its
    own."""
    from splitspec.gpu_actor.kernels.cpu_step import attention

    g = torch.Generator().manual_seed(d + per_kv + n)
    layers, slots, kv, start, layer, scale = 2, 56, 2, 29, 1, d**-0.5
    heads = kv * per_kv
    z = torch.randn(n, (heads + 2 * kv) * d, generator=g)
    k_cache, v_cache = torch.randn(layers, slots, kv, d, generator=g), torch.randn(layers, slots, kv, d, generator=g)
    if n == 3:
        mask = torch.rand(n, start + n, generator=g) < 0.7
        mask[:, -n:] = torch.eye(n, dtype=torch.bool)  # each new row sees itself
    else:
        slot, last = torch.arange(start + n), start + torch.arange(n)[:, None]
        mask = (slot <= last) & (slot > last - window) if window else slot <= last
    angle = torch.rand(n, d // 2, generator=g) * 6
    cos, sin = torch.cat((angle.cos(), angle.cos()), dim=1), torch.cat((angle.sin(), angle.sin()), dim=1)

    def rope(x: torch.Tensor) -> torch.Tensor:  # [n, h, d]
        half = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
        return x * cos[:, None] + half * sin[:, None]

    factors = torch.linspace(1.0, 1.5, n) if by_row else torch.ones(n)  # Ministral 3's q scaling by position
    q = rope(z[:, : heads * d].view(n, heads, d)) * factors[:, None, None]
    k_new = rope(z[:, heads * d : (heads + kv) * d].view(n, kv, d))
    v_new = z[:, (heads + kv) * d :].view(n, kv, d)
    keys = torch.cat((k_cache[layer, :start], k_new)).repeat_interleave(per_kv, dim=1)  # [start + n, heads, d]
    values = torch.cat((v_cache[layer, :start], v_new)).repeat_interleave(per_kv, dim=1)
    scores = q.transpose(0, 1) @ keys.permute(1, 2, 0) * scale  # [heads, n, start + n]
    if cap:  # Gemma 2's soft cap, as transformers' eager attention applies it
        scores = torch.tanh(scores / cap) * cap
    ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ values.transpose(0, 1)
    out = torch.empty(n, heads * d)
    attention(z.numpy(), layer, k_cache.numpy(), v_cache.numpy(), start, mask.numpy().astype(np.uint8),
              cos.numpy(), sin.numpy(), np.float32(scale), heads, 0, 0, np.float32(1e-6), cap, 0,
              factors.numpy().ctypes.data if by_row else 0, out.numpy())  # fmt: skip
    torch.testing.assert_close(k_cache[layer, start : start + n], k_new, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_cache[layer, start : start + n], v_new)
    torch.testing.assert_close(out, ref.transpose(0, 1).reshape(n, heads * d), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("n", "chunk", "shared"), [(256, 72, 256), (217, 72, 216), (64, 64, 64), (31, 72, 0), (200, 16, 0)]
)
def test_the_base_share_applies_to_the_rows_of_requests_of_its_size(n, chunk, shared):
    """A pass's rows go in requests of ``chunk`` rows, the last one the rest: the rows in requests of at least
    ``BASE_SHARE_TOKENS`` (the first ones) are those whose replies carry the CPU actors' share of the base."""
    assert cpu_step.shared_tokens(n, chunk) == shared


if __name__ == "__main__" and sys.argv[1:] == ["avx2"]:
    _check_avx2_kernel()
elif __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the test above, under the interpreter"
    from splitspec.gpu_actor.kernels import triton_base

    check_all_shapes(triton_base.base_matmul, "cpu", every_n=False)
    planes, scale, w = make_base(37, 576)
    x = torch.randn(3, 576)
    assert_matches(triton_base.base_matmul(planes, scale, LEVELS, x.to(torch.bfloat16)), x.bfloat16().float() @ w.T)
    buf = torch.zeros(3, 64)
    triton_base.base_matmul(planes, scale, LEVELS, x, out=buf[:, 20:57])
    assert_matches(buf[:, 20:57], x @ w.T)
    # each path where the other is the default: decode + cuBLAS for 3 tokens, in 4 slices of rows into a
    # slice of columns, and the streaming kernel for 6 tokens (a block of 8)
    triton_base._SLICE_BYTES = 10 * 576 * 4
    for n, few_tokens in ((3, 0), (6, 8)):
        x = torch.randn(n, 576)
        buf = torch.zeros(n, 64)
        triton_base.base_matmul(planes, scale, LEVELS, x, out=buf[:, 20:57], few_tokens=few_tokens)
        assert_matches(buf[:, 20:57], x @ w.T)
    # every block shape the device may pick (``stream_for``), on a matrix with a short last group and a
    # partial row block, for 1 and 3 tokens
    planes, scale, w = make_base(37, 160)
    for block in triton_base.STREAMS:
        for n in (1, 3):
            x = torch.randn(n, 160)
            assert_matches(triton_base.base_matmul(planes, scale, LEVELS, x, block=block), x @ w.T)

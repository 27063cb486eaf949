"""tools.sass: instruction counts of the stage-1 kernels, compiled for sm_90 on the CPU."""
import os
import subprocess
import sys

import pytest
import triton

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COUNT = ("from tools import sass; per, ops = sass.records_pass_per_token(16, 4); "
         "print(per, ops['MUFU'], ops['STG'])")


# Upper bounds per Triton version, between the shipped count (3.6, 3.7, 3.8: 63.5, 3.9: 62.5)
# and the count with Triton's own Philox multiplies (68.5 on 3.6 and 3.9) or libdevice's inner
# log (80-81).
BOUND = {"3.6": 66, "3.7": 66, "3.8": 66, "3.9": 65}
VERSION = ".".join(triton.__version__.split(".")[:2])


def subprocess_env(tmp_path):
    """A fresh process that compiles (no interpreter) and imports the installed tpsample and
    this checkout's tools (linked into its working directory, away from the source tree)."""
    link = tmp_path / "tools"
    if not link.exists():
        os.symlink(os.path.join(ROOT, "tools"), link)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns unless it is set
    return env


@pytest.mark.skipif(not os.path.exists(NVDISASM), reason="Triton ships no nvdisasm here")
@pytest.mark.skipif(VERSION not in BOUND, reason=f"no count measured with Triton {VERSION}")
def test_records_pass_instructions_per_token(tmp_path):
    """The records pass's issue cost per token (91.5 before its argmax and NaN rewrites, 84.0
    after, 63.5 with the polynomial inner log, the one-FMA noise and wide Philox multiplies,
    Triton 3.6). A rise above the bound is a regression to look at."""
    out = subprocess.run([sys.executable, "-c", COUNT], env=subprocess_env(tmp_path), cwd=tmp_path,
                         capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    per, mufu, stg = out.stdout.split()
    assert int(mufu) > 0 and int(stg) > 0  # the noise's lg2 and the record stores are there
    assert 60 <= float(per) <= BOUND[VERSION], f"{per} SASS instructions per token"


# The Gluon kernels as tpsample.launchers launches them, and their SASS instructions in the
# Triton 3.6 build (the one tuned and measured on the devices; 3.7-3.9 give 0.98-1.01 of it).
GLUON_VARIANTS = {
    "ws": ("dict(strategy='ws')", 3536),
    "pp": ("dict(strategy='pp')", 2952),
    "pp_mass": ("dict(strategy='pp', need_mass=True)", 3488),
    "pp_two_samples": ("dict(strategy='pp', num_samples=2)", 13768),
    "pp_cdf": ("dict(strategy='pp', need_mass=True, cdf=True)", 2832),
    "pp_160_rows": ("dict(strategy='pp', B=160, EXTRA_B=64)", 4992),
    "pp_160_rows_mass": ("dict(strategy='pp', B=160, EXTRA_B=64, need_mass=True)", 6064),
    "pp_192_rows": ("dict(strategy='pp', B=192, EXTRA_B=64)", 5192),
    "ws_masked": ("dict(strategy='ws', masked=True)", 3800),
    "ws_listed": ("dict(strategy='ws', listed=True)", 4112),
    "ws_candidates": ("dict(strategy='ws', candidates=True, need_mass=True)", 6584),
    "ws_candidates_raw_masked": ("dict(strategy='ws', candidates=True, need_mass=True, "
                                 "raw_mass=True, masked=True)", 8224),
}
GLUON = ("from tools import sass\n"
         + "".join(f"ops = sass.gluon_ops(**{kw})\n"
                   f"print('{name}', ops['LDL'] + ops['STL'], ops['HGMMA'], sum(ops.values()))\n"
                   for name, (kw, _) in GLUON_VARIANTS.items()))
# Spilled words a variant is known to have, per Triton version (others: the largest):
# the 64-row second tile of pp beside its 128-row accumulator (its calls were still 9 %
# faster than 64-row ws on the H200; tpsample.plan keeps it from log-mass calls, 54 words).
SPILLS = {"pp_192_rows": {"3.6": 30, "3.7": 25, "3.8": 47, "3.9": 80}}
# Against the 3.6 build: ptxas schedules differ by a few instructions a binary across versions;
# a rise past this is a changed kernel, not a scheduling difference.
BUILD_RATIO = 0.03
# The candidate epilogue with the raw plane and the mask drifts further from the 3.6 build
# (up to 3.8 %): its counts on the other versions, measured, stand in for the 3.6 count there.
OTHER_BUILDS = {
    "ws_candidates_raw_masked": {"3.7": 7912, "3.8": 7952, "3.9": 7936},
}


CONTENTION = (
    "import torch\n"
    "from tools import contention, sass\n"
    "for kind, op in (('ffma', 'FFMA'), ('fmul', 'FMUL'), ('imad', 'IMAD'), ('lop3', 'LOP3'),\n"
    "                 ('iadd3', 'IADD3'), ('lea_hi', 'LEA'), ('shf', 'SHF'), ('mufu', 'MUFU'),\n"
    "                 ('hfma2', 'HFMA2'), ('fmnmx', 'FMNMX'), ('i2f', 'I2FP'), ('f2i', 'F2I')):\n"
    "    ops = contention.compiled_ops(kind)\n"
    "    print(kind, ops[op], contention.OPS_PER_STEP[kind])\n"
    "ops = sass.gluon_ops('pp', trace_rows=64)\n"
    "print('pp_trace', ops['LDL'] + ops['STL'], 0)\n"
    "try:\n"
    "    sass.gluon_ops('pp', trace_rows=63)\n"
    "except ValueError as e:\n"
    "    print('pp_trace_shape', int('trace' in str(e)), 1)\n")


GLUON_CHECK = ("from tpsample.kernels import gluon_compat\n"
               "if not gluon_compat.AVAILABLE:\n"
               "    print('unavailable:', gluon_compat.unavailable_reason())\n"
               "    raise SystemExit(0)\n")


def run_gluon_script(script: str, tmp_path) -> list[list[str]]:
    """The whitespace-split lines `script` prints, run in a fresh process with the shipped
    kernels (no interpreter); skips where the Gluon kernels do not compile (another Triton).
    The check runs in that process too: this one may see the source tree's tpsample, which
    has no kernels until installed."""
    out = subprocess.run([sys.executable, "-c", GLUON_CHECK + script], env=subprocess_env(tmp_path),
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.startswith("unavailable:"):
        pytest.skip(out.stdout.strip())
    return [line.split() for line in out.stdout.splitlines() if line.strip()]


@pytest.mark.skipif(not os.path.exists(NVDISASM), reason="Triton ships no nvdisasm here")
def test_contention_microbenchmark_keeps_the_instructions_it_times(tmp_path):
    """tools.contention's cost per instruction divides by OPS_PER_STEP: each kind's loop
    must hold that many of its instruction after ptxas (which fuses chained LOP3s, folds
    repeated conversions and turns some adds into IMADs, so a careless chain times less
    than it claims). Also: pp's clock trace compiles without spills and checks its shape."""
    rows = run_gluon_script(CONTENTION, tmp_path)
    assert len(rows) == 14, rows
    for name, got, want in rows[:-2]:
        # the loop body once (plus a few outside it), not folded to fewer
        assert int(want) <= int(got) <= int(want) + 40, (name, got, want)
    assert rows[-2] == ["pp_trace", "0", "0"] and rows[-1] == ["pp_trace_shape", "1", "1"]


@pytest.mark.skipif(not os.path.exists(NVDISASM), reason="Triton ships no nvdisasm here")
def test_hopper_kernels_compile_without_spills(tmp_path):
    """ws and pp as tpsample.launchers launches them (shipped register budgets) compile for sm_90
    with this Triton, with no spilled words (pp's 64-row second tile: at most SPILLS), one
    sample or two, pp with the cdf records (an
    earlier pp's S > 1 path spilled 134 words), ws with the allowed-token mask and with the
    candidate planes (64-column chunks spilled 110 words); each binary
    within BUILD_RATIO of its instruction count in the Triton 3.6 build."""
    rows = run_gluon_script(GLUON, tmp_path)
    assert [r[0] for r in rows] == list(GLUON_VARIANTS), rows
    for name, spilled, hgmma, total in rows:
        spilled, hgmma, total = int(spilled), int(hgmma), int(total)
        known = SPILLS.get(name, {})
        assert spilled <= known.get(VERSION, max(known.values(), default=0)) and hgmma > 0, (
            name, spilled, hgmma)
        ref = OTHER_BUILDS.get(name, {}).get(VERSION, GLUON_VARIANTS[name][1])
        assert abs(total / ref - 1) <= BUILD_RATIO, f"{name}: {total} instructions, reference: {ref}"


PP_LOOPS = ("from tools import sass\n"
            "for kw in (dict(), dict(need_mass=True), dict(need_mass=True, cdf=True)):\n"
            "    per, body = sass.pp_chunk_loop(**kw)\n"
            "    print(per, body['MUFU'], body['SHFL'])\n")


@pytest.mark.skipif(not os.path.exists(NVDISASM), reason="Triton ships no nvdisasm here")
def test_pp_cdf_records_loop_is_the_cheapest(tmp_path):
    """pp's records loop per token (16 tokens per thread per pass): the cdf
    records, which draw no per-token noise, take at most 42 instructions (39.9 on Triton 3.6),
    under 0.7 of the max merge's (59.2), whose log-mass variant takes 71.9. Each loop within
    BUILD_RATIO of the 3.6 build's (3.7-3.9: 39.6-40.0, 59.2-59.3, 71.9-72.2)."""
    (plain, *_), (mass, *_), (cdf, mufu, shfl) = [
        [float(x) for x in row] for row in run_gluon_script(PP_LOOPS, tmp_path)]
    assert 50 < plain < mass and mufu == 16 and shfl > 0
    assert cdf <= 42 and cdf < 0.7 * plain, (cdf, plain, mass)
    for got, ref in ((plain, 59.2), (mass, 71.9), (cdf, 39.9)):
        assert abs(got / ref - 1) <= BUILD_RATIO, (got, ref)


EXCHANGE = ("from tools import sass\n"
            "for world in (2, 8):\n"
            "    text = sass.exchange_wait_sass(world)\n"
            "    ops = sass.text_ops(text)\n"
            "    print(world, ops['LDL'] + ops['STL'], ops['BPT'], ops['ATOMG'] + ops['ATOM'],\n"
            "          text.count('SR_GLOBALTIMER'))\n")


@pytest.mark.skipif(not os.path.exists(NVDISASM), reason="Triton ships no nvdisasm here")
def test_exchange_wait_compiles_without_a_trap(tmp_path):
    """The symmetric-memory exchange's wait compiles for sm_90 with this Triton (its global
    timer and system-scope atomics), with no spills and no trap instruction (BPT): on a
    missing peer it must end normally, leaving the CUDA context usable."""
    out = subprocess.run([sys.executable, "-c", EXCHANGE], env=subprocess_env(tmp_path),
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    assert [r[0] for r in rows] == ["2", "8"], rows
    for world, spilled, traps, atomics, timer_reads in rows:
        assert spilled == "0" and traps == "0", (world, spilled, traps)
        assert int(atomics) >= 2 and int(timer_reads) >= 2, (world, atomics, timer_reads)


LISTED = (
    "from tools import sass\n"
    "from tpsample.kernels import listed_records as lr\n"
    "from tpsample import launchers as L\n"
    "aligned = ('K', 'D', 'W', 'stride_ids', 'stride_hb', 'stride_wv', 'stride_mask',\n"
    "           'stride_eff', 'n_real')\n"
    "for chunk, block in ((16, 16), (64, 64), (64, 256)):\n"
    "    ops = sass.sass_ops(lr.listed_prep_kernel, dict(\n"
    "        HAS_MASK=True, BLOCK_W=L.LISTED_BLOCK_W, BLOCK_K=block,\n"
    "        SPLIT_D=L.listed_split_d(4096), CHUNK_K=chunk, PDL=True), 4, aligned=aligned)\n"
    "    print(chunk, block, ops['LDL'] + ops['STL'], ops['LDG'])\n")


def test_listed_prep_compiles_at_the_launched_shapes(tmp_path):
    """listed_prep_kernel compiles for sm_90 at the chunk sizes tpsample.launchers uses, with
    the integer arguments specialised as a launch does (multiples of 16): Triton 3.6 once
    failed on its dot products' select between 1D tensors of different parents (CHUNK_K =
    64)."""
    out = subprocess.run([sys.executable, "-c", LISTED], env=subprocess_env(tmp_path),
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    assert [r[:2] for r in rows] == [["16", "16"], ["64", "64"], ["64", "256"]], rows
    assert all(int(r[3]) > 0 for r in rows), rows


DRAFT_SCAN = (
    "from tools import sass\n"
    "from tpsample.kernels import draft_scan as ds\n"
    "i64 = lambda *names: {n: '*i64' for n in names}\n"
    "for draft in ('*i64', '*i32'):\n"
    "    for S, block in ((0, 1), (4, 8), (7, 8)):\n"
    "        t = dict(i64('seed_ptr', 'offset_ptr', 'n_ptr', 'seed_rows_ptr', 'offset_rows_ptr'),\n"
    "                 bad_ptr='*i32', draft_ptr=draft)\n"
    "        a = sass.sass_ops(ds.draft_rows_kernel, dict(S=S, BLOCK=block), 1, types=t)\n"
    "        t = dict(i64('y_ptr', 'n_ptr', 'tokens_ptr', 'accepted_ptr'), draft_ptr=draft)\n"
    "        b = sass.sass_ops(ds.accept_scan_kernel, dict(S=S, BLOCK=block, HAS_LP=True), 1,\n"
    "                          types=t)\n"
    "        print(draft, S, a['STG'], b['STG'], a['LDL'] + a['STL'] + b['LDL'] + b['STL'])\n"
    "t = dict(i64('ids_ptr', 'draft_ptr', 'ptop_ptr', 'cut_id_ptr', 'n_ptr', 'seed_rows_ptr',\n"
    "             'offset_rows_ptr', 'accepted_ptr', 'pid_ptr', 'tokens_ptr', 'rtop_ptr'),\n"
    "         pnan_ptr='*i32', bad_ptr='*i32', pmass_ptr='*i32', pz_ptr='*fp64', lpx_ptr='*fp64',\n"
    "         plp_ptr='*fp64', rlogz_ptr='*fp64')\n"
    "for name, k, c, w in (\n"
    "        ('max', ds.probs_max_kernel, dict(S=4, CHUNK=4096, SCALE=True, MASS=True,\n"
    "                                          ARANGE=True), 8),\n"
    "        ('mass', ds.probs_mass_kernel, dict(HAS_CUT=True, BLOCK_G=64, CHUNK=4096, BLOCK=1024,\n"
    "                                            SCALE=True, ARANGE=False), 4),\n"
    "        ('accept', ds.probs_accept_kernel, dict(ACCEPT=1 << 29, S=4, HAS_CUT=True,\n"
    "                                                BLOCK_G=64, BLOCK_S=8, MASS=True), 4),\n"
    "        ('pick', ds.probs_pick_kernel, dict(S=4, HAS_CUT=True, CHUNK=1024, BLOCK=256,\n"
    "                                            SCALE=True, ARANGE=True), 4),\n"
    "        ('finish', ds.probs_finish_kernel, dict(S=4, HAS_LP=True, BLOCK_G=256,\n"
    "                                                BLOCK_S=8), 4)):\n"
    "    o = sass.sass_ops(k, c, w, types=t)\n"
    "    print(name, 'x', o['STG'], o['STG'], o['LDL'] + o['STL'])\n")


def test_draft_scan_kernels_compile(tmp_path):
    """The speculative-verification kernels (kernels/draft_scan.py) compile for sm_90 with
    this Triton at the launched argument types (int64 / int32 drafts; the draft-probs
    kernels), without spills."""
    out = subprocess.run([sys.executable, "-c", DRAFT_SCAN], env=subprocess_env(tmp_path),
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    assert len(rows) == 11, rows
    assert all(int(r[2]) > 0 and int(r[3]) > 0 and r[4] == "0" for r in rows), rows

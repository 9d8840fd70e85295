"""The C kernels of the CPU forward (inflight/engine/model/cpu_kernels.c), each against a float64 reference written out
plainly here; the runner with them against the runner without them; the build's cache and its fallbacks."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.engine.model import cpu_kernels
from inflight.engine.model.llama_runner import LlamaRunner
from inflight.engine.scheduler.step import StepPlan
from inflight.native import build as native

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def K() -> cpu_kernels.Kernels:
    lib = cpu_kernels.load()
    assert lib is not None, "a C compiler is on PATH, so the kernels must build"
    return cpu_kernels.Kernels(lib)


@pytest.fixture(scope="module")
def K_portable(K, tmp_path_factory) -> cpu_kernels.Kernels:
    """The same source built without AVX-512 where the host has it: the plain-C paths that other CPUs run."""
    if "avx512f" not in native.cpu_id():
        return K
    so = tmp_path_factory.mktemp("kernels") / "portable.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    native.build(cc, so, cpu_kernels.SOURCE, [*native.FLAGS, "-mno-avx512f"])
    return cpu_kernels.Kernels(native.open_library(so, cpu_kernels._SIGNATURES))


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-6) -> None:
    err = ((got.double() - want) / want.abs().clamp_min(1.0)).abs().max().item()
    assert err < tol, err


def test_rms_norm_matches_float64(K):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(9, 200, generator=g) * 3
    x = wide[:, :144]  # rows 200 floats apart: the kernel reads strided rows
    w = torch.randn(144, generator=g)
    xd = x.double()
    want = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * w.double()
    _close(K.rms_norm(x, w, 1e-6), want)


def _rope64(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """HF llama's rotary embedding in float64: x [N, heads, D] at positions pos [N]."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv[None]  # [N, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + rot * sin


def test_rope_and_cache_matches_float64_and_writes_only_its_rows(K):
    H, KV, D, T, slots_n = 4, 2, 16, 12, 5
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, (H + 2 * KV) * D, generator=g)
    orig = qkv.double().clone()
    positions = torch.tensor([3, 0, 7, 11, 4, 5])
    slots = torch.tensor([4, 1, 1, 0, 2, 2])
    pos_all = torch.arange(T, dtype=torch.float64)
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos_all[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([-ang.sin(), ang.sin()], -1).float()  # rotate_half's sign carried by the table
    kc = torch.full((slots_n, KV, T, D), 7.0)
    vc = torch.full((slots_n, KV, T, D), 7.0)
    K.rope_and_cache(qkv, H, KV, D, cos, sin, positions, slots, kc, vc)
    heads = orig.view(6, H + 2 * KV, D)
    want_qk = _rope64(heads[:, : H + KV], positions)
    _close(qkv.view(6, H + 2 * KV, D)[:, : H + KV], want_qk)
    assert torch.equal(qkv.view(6, H + 2 * KV, D)[:, H + KV :].double(), heads[:, H + KV :])  # v untouched
    written = torch.zeros(slots_n, T, dtype=torch.bool)
    for i, (s, p) in enumerate(zip(slots.tolist(), positions.tolist())):
        _close(kc[s, :, p], want_qk[i, H:])
        assert torch.equal(vc[s, :, p].double(), heads[i, H + KV :])
        written[s, p] = True
    assert (kc.permute(0, 2, 1, 3)[~written] == 7.0).all() and (vc.permute(0, 2, 1, 3)[~written] == 7.0).all()


def _attention64(q, kc, vc, slots, lens, scale):
    """Per sequence and head, softmax(scale q.K) V over the first len cached positions, float64."""
    nd, H, D = q.shape
    KV = kc.shape[1]
    out = torch.empty(nd, H, D, dtype=torch.float64)
    for b in range(nd):
        for h in range(H):
            k = kc[slots[b], h // (H // KV), : lens[b]].double()
            v = vc[slots[b], h // (H // KV), : lens[b]].double()
            s = (k @ q[b, h].double()) * scale
            a = torch.exp(s - s.max())
            out[b, h] = (a / a.sum()) @ v
    return out


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("H,KV,D", [(4, 2, 32), (8, 8, 64), (6, 2, 48), (4, 1, 128), (14, 2, 24)])  # 48, 24: generic
def test_cached_attention_matches_float64_and_reads_only_cached_positions(K, K_portable, build, H, KV, D):
    K = K if build == "native" else K_portable
    g = torch.Generator().manual_seed(H * D)
    T, nd = 40, 5
    kc, vc = torch.randn(7, KV, T, D, generator=g) * 2, torch.randn(7, KV, T, D, generator=g)
    slots = torch.tensor([6, 0, 3, 2, 5])  # not consecutive: no gather needed
    lens = torch.tensor([1, 40, 17, 33, 2])
    for s, n in zip(slots.tolist(), lens.tolist()):  # past each length: poison that must never be read
        kc[s, :, n:] = float("nan")
        vc[s, :, n:] = float("nan")
    row = torch.randn(nd, H * D + 24, generator=g)  # q rows strided, as in the qkv projection's output
    q = row[:, : H * D].view(nd, H, D)
    out = torch.empty(nd, H, D)
    scale = 1 / math.sqrt(D)
    K.cached_attention(q, kc, vc, slots, lens, int(lens.max()), scale, out)
    _close(out, _attention64(q, kc, vc, slots, lens, scale))


def test_silu_mul_matches_float64_without_overflow(K):
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(5, 2 * 70, generator=g) * 4
    gu[0, :4] = torch.tensor([-200.0, 200.0, -90.0, 0.0])  # exp(-x) overflows float32 for the naive formula
    gd = gu.double()
    gate, up = gd[:, :70], gd[:, 70:]
    want = gate * torch.sigmoid(gate) * up
    got = K.silu_mul(gu)
    assert torch.isfinite(got).all()
    _close(got, want)


@pytest.mark.parametrize("threads", [1, 2])  # 2: the C rope and norms with torch's attention
def test_runner_with_kernels_matches_runner_without(K, tiny_model_dir, threads):
    """Prefill chunks, then decodes of sequences of different lengths in non-consecutive slots: same logits."""
    torch.set_num_threads(threads)
    try:
        _compare_runners(tiny_model_dir)
    finally:
        torch.set_num_threads(1)


def _compare_runners(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runners = [LlamaRunner(model, max_batch=6, max_model_len=32, kernels=k) for k in (True, False)]
    assert runners[0].kernels is not None and runners[1].kernels is None
    g = torch.Generator().manual_seed(4)
    vocab = model.config.vocab_size
    prompts = {5: 9, 1: 3, 3: 6}  # slot: prompt length
    steps = [[(s, 0, torch.randint(3, vocab, (n,), generator=g).tolist()) for s, n in prompts.items()]]
    lens = dict(prompts)
    late = torch.randint(3, vocab, (11,), generator=g).tolist()  # slot 0 joins late, its prompt in two chunks
    for i in range(4):
        steps.append([(s, lens[s], [int(torch.randint(3, vocab, (1,), generator=g))]) for s in sorted(lens)])
        lens = {s: n + 1 for s, n in lens.items()}
        if i == 2:
            steps[-1].append((0, 0, late[:4]))
        if i == 3:  # a chunk continuing a cached prefix, beside decodes: causal over prefix + itself
            steps[-1].append((0, 4, late[4:]))
    for chunks in steps:
        plan = StepPlan.build(chunks, [True] * len(chunks), torch.device("cpu"))
        with_c, without = (r.forward(plan) for r in runners)
        assert (with_c - without).abs().max().item() < 1e-5
    assert plan.num_decode == 3 and plan.decode_first_slot is None and plan.prefills[0][1:3] == (4, 7)


def test_built_once_into_the_cache_and_off_or_missing_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("INFLIGHT_KERNEL_DIR", str(tmp_path / "k"))
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is not None
        (so,) = (tmp_path / "k").glob("cpu_kernels-*.so")
        mtime = so.stat().st_mtime_ns
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load() is not None and so.stat().st_mtime_ns == mtime  # loaded, not rebuilt
        assert list((tmp_path / "k").iterdir()) == [so]  # no temporary file left behind

        cpu_kernels.load.cache_clear()
        monkeypatch.setenv("INFLIGHT_CPU_KERNELS", "0")
        assert cpu_kernels.load() is None
        assert not cpu_kernels.usable(torch.device("cpu"), torch.float32, 32)

        cpu_kernels.load.cache_clear()
        monkeypatch.setenv("INFLIGHT_CPU_KERNELS", "1")
        monkeypatch.setenv("INFLIGHT_KERNEL_DIR", str(tmp_path / "other"))
        monkeypatch.setenv("CC", "false")  # a compiler that fails: a warning and the torch path, no crash
        assert cpu_kernels.load() is None
        assert "could not build cpu_kernels.c" in caplog.text
        assert not (tmp_path / "other").exists() or not list((tmp_path / "other").iterdir())
    finally:
        cpu_kernels.load.cache_clear()


def test_not_used_off_cpu_float32():
    assert not cpu_kernels.usable(torch.device("cpu"), torch.bfloat16, 32)
    assert not cpu_kernels.usable(torch.device("meta"), torch.float32, 32)
    assert not cpu_kernels.usable(torch.device("cpu"), torch.float32, cpu_kernels.MAX_HEAD_DIM + 1)


def test_sample_rows_match_float64_inverse_cdf_and_torch_sampler(K):
    """Tokens by the inverse CDF at u of softmax(logits / T) (greedy at T = 0), logprobs under that distribution:
    against float64, and the same tokens as sampling.sample's torch path for the same u."""
    from inflight.engine.model.sampling import sample

    g = torch.Generator().manual_seed(3)
    B, V = 64, 1000
    logits = torch.randn(B, V, generator=g) * 3
    logits[5, 7:900] = float("-inf")  # masked tokens are never drawn
    temp = torch.tensor([0.0, 0.3, 1.0, 1.7] * (B // 4))
    u = torch.rand(B, generator=g)
    u[2], u[3] = 0.0, 1 - 2**-24  # the ends of [0, 1)
    tokens, logprobs = K.sample(logits, temp, u)

    x = logits.double()
    greedy = temp == 0
    t = torch.where(greedy, torch.ones_like(temp), temp).double()
    logp = torch.log_softmax(x / t[:, None], -1)
    cdf = logp.exp().cumsum(-1)
    for b in range(B):
        if greedy[b]:
            want = int(x[b].argmax())
        else:
            target = float(u[b]) * float(cdf[b, -1])
            want = int((cdf[b] > target).nonzero()[0])
            lo = float(cdf[b, want - 1]) if want else 0.0
            if min(target - lo, float(cdf[b, want]) - target) < 1e-5:  # within rounding of a boundary
                continue
        assert int(tokens[b]) == want, b
        assert abs(float(logprobs[b]) - float(logp[b, want])) < 1e-5, b
    assert int(tokens[5]) < 7 or int(tokens[5]) >= 900

    ones = torch.ones(B)
    t_tok, t_lp, _ = sample(logits, temp, ones, torch.zeros(B, dtype=torch.long), u, 0, False)
    assert (t_tok != tokens).sum() <= 1  # a boundary case at most
    same = t_tok == tokens
    assert (t_lp[same] - logprobs[same]).abs().max() < 1e-5


def test_copy_finite_copies_every_bit_and_counts_nan_and_inf(K):
    g = torch.Generator().manual_seed(3)
    src = torch.randn(10_007, generator=g)
    src[:6] = torch.tensor([3.4e38, -3.4e38, 1e-45, -0.0, 1e-40, 0.0])  # extremes, denormals, signed zero: finite
    dst = torch.full_like(src, 7.0)
    assert K.copy_finite(dst, src) and torch.equal(dst.view(torch.int32), src.view(torch.int32))
    for bad in (float("nan"), float("inf"), float("-inf")):
        s = src.clone()
        s[-1] = bad  # the loop's tail, past any vector width
        assert not K.copy_finite(dst, s) and torch.equal(dst.view(torch.int32), s.view(torch.int32))
    s = src.clone()
    s[100] = float("nan")
    s[200] = float("inf")
    assert not K.copy_finite(dst, s)
    assert K.copy_finite(dst[:0], src[:0])  # nothing to copy

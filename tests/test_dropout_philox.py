"""Dropout's element -> Philox counter contract, pinned by an independent reference: a
numpy Philox4x32-10 (checked against Random123's known-answer vectors) gives the keep
mask of every element, and flashgen.dropout_mask and the kernels must draw exactly it.

Contract (flashgen.dropout): element (i, j) of head plane bh = z * num_heads + h takes
output j % 4 of Philox4x32-10 with key (seed lo, seed hi) and counter
(c lo, c hi, 0, 0), c = offset + (bh * seqlen_q + i) * ceil(seqlen_k / 4) + j // 4, and
is kept iff that output's uniform (Triton's uint_to_uniform_float) >= dropout_p."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashgen
from flashgen import dropout, ops, reference
from flashgen.masks import mask_bounds
from flashgen.spec import TileConfig

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_LO = np.uint64(0xFFFFFFFF)


def philox4x32(c0, c1, c2, c3, k0, k1, rounds=10):
    """Philox4x32 (Salmon et al. 2011; Random123's philox4x32_R) on uint32 arrays."""
    c = [np.asarray(x, dtype=np.uint32) for x in (c0, c1, c2, c3)]
    k0, k1 = np.asarray(k0, dtype=np.uint32), np.asarray(k1, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for _ in range(rounds):
            p0 = _M0 * c[0].astype(np.uint64)
            p1 = _M1 * c[2].astype(np.uint64)
            hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), (p0 & _LO).astype(np.uint32)
            hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), (p1 & _LO).astype(np.uint32)
            c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
            k0, k1 = k0 + _W0, k1 + _W1
    return c


def uniform(x):
    """Triton's uint_to_uniform_float for 32-bit x: as int32, x < 0 -> -x - 1, then
    times 4.6566127342e-10 in float32."""
    x = np.asarray(x, dtype=np.uint32).view(np.int32).astype(np.int64)
    x = np.where(x < 0, -x - 1, x).astype(np.float32)
    return x * np.float32(4.6566127342e-10)


def reference_keep(seed, offset, batch, num_heads, seqlen_q, seqlen_k, p):
    """The contract's keep mask, bool (batch, num_heads, seqlen_q, seqlen_k)."""
    groups = -(-seqlen_k // 4)
    rows = np.arange(batch * num_heads * seqlen_q, dtype=np.uint64)[:, None]
    j = np.arange(seqlen_k, dtype=np.uint64)[None, :]
    ctr = (np.uint64(offset) + rows * np.uint64(groups) + j // np.uint64(4)).astype(np.uint64)
    out = philox4x32((ctr & _LO).astype(np.uint32), (ctr >> np.uint64(32)).astype(np.uint32), 0, 0,
                     seed & 0xFFFFFFFF, seed >> 32)
    lane = (j % np.uint64(4)).astype(np.int64)
    bits = np.choose(np.broadcast_to(lane, ctr.shape), out)
    keep = uniform(bits) >= np.float32(p)
    return torch.from_numpy(keep.reshape(batch, num_heads, seqlen_q, seqlen_k))


def test_numpy_philox_known_answers():
    """Random123's kat_vectors for philox4x32 with 10 rounds."""
    def kat(ctr, key):
        return [int(x) for x in philox4x32(*[np.uint32(c) for c in ctr], np.uint32(key[0]), np.uint32(key[1]))]

    assert kat((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert kat((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert kat((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.mark.parametrize("seed,offset", [(7, 0), (0x1234_5678_9ABC, 5), (3, 2**32 - 3)])
@pytest.mark.parametrize("shape", [(2, 3, 5, 16), (1, 2, 7, 13), (1, 1, 3, 70), (2, 1, 4, 1)])
def test_dropout_mask_is_the_contracts(seed, offset, shape):
    """seqlen_k a multiple of 4 and of 16, not a multiple of 4 (13, 1), a multiple of 2
    only (70); offsets whose counters carry into the high word."""
    st = torch.tensor([seed, offset], dtype=torch.int64)
    got = flashgen.dropout_mask(st, *shape, 0.3)
    want = reference_keep(seed, offset, *shape, 0.3)
    assert torch.equal(got, want)


def test_counters_reserved_per_call():
    assert dropout.counters(2, 3, 5, 13) == 2 * 3 * 5 * 4
    assert dropout.counters(1, 1, 1, 16) == 4
    assert dropout.counters(1, 1, 1, 0) == 0
    # consecutive calls' counters do not overlap: the next call's first counter is
    # past this call's last
    b, h, sq, sk = 1, 2, 3, 9
    assert dropout.counters(b, h, sq, sk) == (b * h * sq - 1) * dropout.counters_per_row(sk) + (sk - 1) // 4 + 1


def test_kernels_draw_the_contracts_mask():
    """The forward (two tile configs: 16 and 64 key columns) and the backward (dQ and
    the transposed dK/dV tile) drop exactly the contract's elements: seqlen_k = 45 is
    neither a multiple of 4 nor of BLOCK_N, and the offset's counters carry into the
    high word."""
    g = torch.Generator().manual_seed(0)
    sq, sk, d = 21, 45, 16
    q, k, v = (torch.randn(1, 2, n, d, generator=g) for n in (sq, sk, sk))
    seed, offset, p = 0x0BAD_CAFE_F00D, 2**32 - 100, 0.35
    rng = torch.tensor([seed, offset], dtype=torch.int64)
    keep = reference_keep(seed, offset, 1, 2, sq, sk, p)
    mods = ops.ScoreMods(dropout_p=p, rng=rng)
    for causal in (False, True):
        _, lo, hi = mask_bounds(sq, sk, causal=causal, window=(-1, -1))
        ref, _, _ = reference.forward_bounds(q, k, v, 0.25, lo, hi, keep=keep, dropout_p=p)
        for cfg in (TileConfig(16, 16, 1, 1), TileConfig(32, 64, 4, 2)):
            o, _ = ops.fwd(q, k, v, softmax_scale=0.25, mask="causal" if causal else "none",
                           diag_lo=lo, diag_hi=hi, config=cfg, mods=mods)
            assert (o.double() - ref).abs().max() < 1e-4, (causal, cfg)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        st = rng.clone()
        o = flashgen.attention(qg, kg, vg, causal=causal, softmax_scale=0.25, dropout_p=p, rng_state=st)
        assert st.tolist() == [seed, offset + dropout.counters(1, 2, sq, sk)]
        do = torch.randn(o.shape, generator=g)
        o.backward(do)
        want = reference.backward(do, q, k, v, causal=causal, softmax_scale=0.25, keep=keep, dropout_p=p)
        for name, got, w in zip(("dQ", "dK", "dV"), (qg.grad, kg.grad, vg.grad), want):
            assert (got.double() - w).abs().max() < 1e-3, (causal, name)

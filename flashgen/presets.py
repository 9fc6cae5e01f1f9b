"""Named sets of problem sizes to tune.

A preset entry is (head_dim, mask, Shape), plus the kernel in decode presets (where
Shape.seqlen_k is the cache length); :func:`expand` turns entries into
(ProblemKey, Shape) pairs for each requested kernel and dtype, keeping the first shape
of each bucket (:class:`flashgen.spec.ProblemKey`).
"""

from __future__ import annotations

from collections.abc import Iterable

from .spec import DENSE_KERNELS, WHOLE_BWD, KernelSpec, ProblemKey, Shape, base_kernel, is_decode, whole_bwd_mods

Entry = tuple  # (head_dim (= head_dim_v), mask, Shape[, kernel in decode presets | mods in dense ones]);
#               user presets: (head_dim, example name, Shape)


def _fa_grid() -> list[Entry]:
    """FlashAttention's benchmark grid: 16384 tokens per batch, model width 2048."""
    return [(d, mask, Shape(16384 // n, 2048 // d, 2048 // d, n, n))
            for d in (64, 128) for mask in ("none", "causal")
            for n in (512, 1024, 2048, 4096, 8192, 16384)]


def _llama3_8b() -> list[Entry]:
    """Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128, causal."""
    return [(128, "causal", Shape(b, 32, 8, n, n))
            for b in (1, 2, 4, 8) for n in (1024, 2048, 4096, 8192)]


def _head_dims() -> list[Entry]:
    """The head dims of models besides 64 and 128, at 16384 tokens per batch, seqlen
    1024-8192, causal and not: head_dim 96 with 32 query and KV heads (Phi-3-mini's
    attention) and head_dim 256 with 8 query and 4 KV heads (Gemma's)."""
    return [(d, mask, Shape(16384 // n, h, hk, n, n))
            for d, h, hk in ((96, 32, 32), (256, 8, 4)) for mask in ("causal", "none")
            for n in (1024, 2048, 4096, 8192)]


def _small() -> list[Entry]:
    """Tiny shapes for CPU smoke tests (one MHA, one GQA with odd length)."""
    return [(64, "none", Shape(1, 2, 2, 128, 128)), (64, "causal", Shape(1, 4, 2, 97, 97))]


def _varlen_docs() -> list[Entry]:
    """Packed documents (ragged batches, ``attention_varlen``): Llama-3-8B heads (32
    query, 8 KV), head_dim 128, causal and not; Shape.batch documents of lengths up to
    Shape.seqlen_q (:func:`flashgen.spec.varlen_lengths` draws them), 22-26k tokens
    per batch."""
    return [(128, mask, Shape(16384 // n * 2, 32, 8, n, n))
            for mask in ("causal", "none") for n in (512, 1024, 2048, 4096, 8192)]


#: (head_dim, seqlen) of ``benchmarks/mods_bench.py``'s default shapes.
MODS_BENCH_SHAPES = ((128, 2048), (128, 8192), (64, 2048))


def _mods_bench() -> list[Entry]:
    """The score mods (softcap, ALiBi, bias, dropout) on the shapes of
    ``benchmarks/mods_bench.py`` (:data:`MODS_BENCH_SHAPES`): 16 heads, 16k tokens per
    batch, head_dim 128 at seqlen 2048 and 8192 and head_dim 64 at 2048, causal and
    not."""
    return [(d, mask, Shape(16384 // n, 16, 16, n, n), mods)
            for mods in ("softcap", "alibi", "bias", "dropout") for mask in ("none", "causal")
            for d, n in MODS_BENCH_SHAPES]


def _mods_d64() -> list[Entry]:
    """The head_dim 64 entries of ``mods-bench`` alone (all four score mods)."""
    return [e for e in _mods_bench() if e[0] == 64]


def _mods_one(mod: str):
    """The ``mod`` entries of ``mods-bench`` alone: a re-tune of one score mod after its
    kernels' code changed (its old rows no longer match the code hash)."""
    def entries() -> list[Entry]:
        return [e for e in _mods_bench() if e[3] == mod]
    entries.__doc__ = f"The ``{mod}`` entries of ``mods-bench`` alone (a re-tune of that score mod)."
    return entries


def _mods_small() -> list[Entry]:
    """Tiny score-mod problems for CPU smoke tests."""
    return [(32, "causal", Shape(1, 2, 1, 37, 37), "softcap_alibi"), (32, "none", Shape(1, 2, 2, 33, 45), "bias")]


def _varlen_small() -> list[Entry]:
    """Tiny ragged batches for CPU smoke tests."""
    return [(64, "causal", Shape(3, 2, 1, 97, 97))]


#: The page size of the paged-cache decode entries (the kernel serves any multiple of
#: 16; the page size is a runtime value, not part of the problem key).
DECODE_PAGE_SIZE = 64


def _decode() -> list[Entry]:
    """Decode with a KV cache (``attention_with_kvcache``): Llama-3-8B heads (32 query,
    8 KV), head_dim 128; batch 1, 8, 32; caches of 4k, 32k and 128k tokens (Shape.seqlen_k,
    every entry full); seqlen_q 1 (a decode step) and 4 (a short speculative chunk,
    causal); contiguous caches, and paged ones (page size DECODE_PAGE_SIZE) for 32k and
    128k."""
    out = []
    for b in (1, 8, 32):
        for n in (4096, 32768, 131072):
            for sq, mask in ((1, "none"), (4, "causal")):
                out.append((128, mask, Shape(b, 32, 8, sq, n), "decode"))
                if n >= 32768:
                    out.append((128, mask, Shape(b, 32, 8, sq, n), "decode_paged"))
    return out


def _decode_form() -> list[Entry]:
    """Where the dense forward's flash-decoding form pays (``library.decode_form``): the
    decode kernel at Llama-3-8B heads (32 / 8), head_dim 128, batch 1 and 8, caches of 4k
    and 32k tokens, over seqlen_q 1 to 64 (4 to 256 query rows per kv head; bottom-right
    causal from seqlen_q 2), which ``benchmarks/decode_bench.py --preset decode-form``
    times beside the forward kernels on the same calls (``flashgen-attention-tiles``)."""
    return [(128, "none" if sq == 1 else "causal", Shape(b, 32, 8, sq, n), "decode")
            for b in (1, 8) for n in (4096, 32768) for sq in (1, 4, 16, 32, 64)]


def _decode_small() -> list[Entry]:
    """Tiny decode problems for CPU smoke tests."""
    return [(64, "none", Shape(2, 4, 1, 1, 100), "decode"), (64, "causal", Shape(2, 4, 2, 3, 96), "decode_paged")]


def _user_examples() -> list[Entry]:
    """The examples of :mod:`flashgen.user_examples` (user score/mask functions and sinks)
    at ``benchmarks/user_mods_bench.py``'s default size: batch 8, 16 heads, seqlen
    2048, head_dim 128.  Entries are (head_dim, example name, Shape); tuned by
    :mod:`flashgen.user_tune` (their keys' ``mods`` are the lowered functions' names)."""
    from .user_examples import NAMES

    return [(128, name, Shape(8, 16, 16, 2048, 2048)) for name in NAMES]


def _user_small() -> list[Entry]:
    """Three of the user examples (a learned table with its gradient, a document mask
    with causal, sinks) at a tiny size, for CPU smoke tests."""
    return [(16, name, Shape(1, 2, 2, 64, 64)) for name in ("relpos", "document-causal", "sinks")]


PRESETS = {"fa-grid": _fa_grid, "llama3-8b": _llama3_8b, "head-dims": _head_dims, "small": _small,
           "varlen-docs": _varlen_docs, "varlen-small": _varlen_small,
           "decode": _decode, "decode-form": _decode_form, "decode-small": _decode_small,
           "mods-bench": _mods_bench,
           "mods-small": _mods_small, "mods-d64": _mods_d64,
           **{f"mods-{m}": _mods_one(m) for m in ("softcap", "alibi", "bias", "dropout")},
           "user-examples": _user_examples, "user-small": _user_small}
#: Presets of ragged batches: their entries are tuned with the varlen kernels
#: (``fwd`` given to ``--kernels`` means ``fwd_varlen`` there, and the reverse).
VARLEN_PRESETS = {"varlen-docs", "varlen-small"}
#: Presets of decode problems: each entry names its kernel (decode or decode_paged);
#: ``--kernels`` selects among them when it names a decode kernel, else all run.
DECODE_PRESETS = {"decode", "decode-form", "decode-small"}
#: Presets whose entries carry score mods (a 4th element: KernelSpec.mods).
#: Presets of user functions (:mod:`flashgen.user_examples`): :func:`expand` does not
#: take them (their keys come from tracing the functions: :func:`flashgen.user_tune.items`
#: of :func:`flashgen.user_tune.preset_problems`).
USER_PRESETS = {"user-examples", "user-small"}
MODS_PRESETS = {"mods-bench", "mods-d64", "mods-small", "mods-softcap", "mods-alibi", "mods-bias", "mods-dropout"}


def expand(names: Iterable[str], dtype: str = "bfloat16",
           kernels: Iterable[str] | None = None) -> list[tuple[ProblemKey, Shape]]:
    """(ProblemKey, Shape) for every entry of the named presets and every kernel, in
    preset order; a key already produced keeps its first shape.  Dense presets tune
    the dense kernels and varlen presets the varlen ones, whichever of the two names
    of a kernel ``kernels`` gives (``bwd``, the whole backward, only in presets without
    bias or dropout; ``bwd_varlen`` in varlen presets); decode presets tune each entry's
    own kernel among the decode kernels ``kernels`` names.  ``kernels`` None: each
    preset's own (the dense kernels of :data:`DENSE_KERNELS`, every decode entry).
    Raises KeyError naming the known presets for an unknown name."""
    out: dict[ProblemKey, Shape] = {}
    if kernels is None:
        training, decode = DENSE_KERNELS, None
    else:
        kernels = tuple(kernels)
        training = tuple(k for k in kernels if not is_decode(k))
        decode = tuple(k for k in kernels if is_decode(k))
    for name in names:
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        if name in USER_PRESETS:
            raise KeyError(f"preset {name!r} holds user functions: flashgen.user_tune.preset_problems makes its "
                           "keys (flashgen tune --preset does)")
        if name in DECODE_PRESETS:
            for d, mask, shape, k in PRESETS[name]():
                if decode is None or k in decode:
                    out.setdefault(shape.key(KernelSpec(k, dtype, d, d, mask)), shape)
            continue
        varlen = name in VARLEN_PRESETS
        # (the whole backward ``bwd`` of a varlen preset is ``bwd_varlen``)
        kinds = tuple(dict.fromkeys((f"{base_kernel(k)}_varlen" if varlen else base_kernel(k)) for k in training))
        for d, mask, shape, *mods in PRESETS[name]():
            for k in kinds:
                if k == WHOLE_BWD and mods and not whole_bwd_mods(mods[0]):
                    continue  # bias and dropout are compiled into bwd_dq and bwd_dkdv only
                key = shape.key(KernelSpec(k, dtype, d, d, mask, *mods))
                out.setdefault(key, shape)
    return list(out.items())

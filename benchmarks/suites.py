"""The benchmark suites: one registry line each (``python -m benchmarks <suite>``).

A suite is a command (or a few) that checks flashgen against the float64 reference
before it times anything, writes JSON under the output directory and prints its table
last.  Each step is ``python3 ARGS...`` run from the repository root with the
repository on PYTHONPATH; ``{out}`` in ARGS is the suite's output directory, and the
extra arguments given after ``--`` go to the first step.  ``plot`` names the
:mod:`benchmarks.plots` kind drawn from ``results`` afterwards (into ``{out}``);
``table`` re-prints a dense run's table from its JSON (``merge_bench.py``), so the table
comes last.  Adding a suite is one line in :data:`SUITES`.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The backends of the dense suites: flashgen (tuned rows, and the heuristic default
#: with no database) beside SDPA's cuDNN and FlashAttention-2 backends and FlexAttention.
DENSE_BACKENDS = "flashgen,flashgen-default,sdpa-cudnn,sdpa-flash,flex"


@dataclass(frozen=True)
class Suite:
    name: str
    what: str
    steps: tuple[tuple[str, ...], ...]
    results: tuple[str, ...] = ()   # JSON files under {out}
    plot: str | None = None          # benchmarks.plots.KINDS key
    table: bool = False              # print merge_bench's table of results last
    needs: str | None = None         # a file that must exist (else the suite says so and stops)


def _dense(name: str, preset: str, what: str) -> Suite:
    return Suite(name, what, (("-m", "flashgen", "bench", "--preset", preset, "--backends", DENSE_BACKENDS,
                               "--no-plots", "--out", "{out}"),),
                 results=("bench.json",), plot="dense", table=True)


SUITES: dict[str, Suite] = {s.name: s for s in (
    _dense("grid", "fa-grid", "FlashAttention's grid: head_dim 64/128, none/causal, seqlen 512-16384 at 16k "
           "tokens; fwd, bwd, fwd+bwd TFLOP/s and peak memory (about 5 min on an H200)"),
    _dense("llama", "llama3-8b", "Llama-3-8B attention: 32/8 heads, head_dim 128, causal, batch 1-8, "
           "seqlen 1024-8192"),
    _dense("head-dims", "head-dims", "head_dim 96 (32 heads) and 256 (8/4 heads), none/causal, seqlen "
           "1024-8192 at 16k tokens"),
    Suite("mods", "score mods (softcap, ALiBi, bias, dropout) against FlexAttention score_mods and SDPA",
          (("benchmarks/mods_bench.py", "--out", "{out}/mods.json"),), ("mods.json",), "mods"),
    Suite("varlen", "ragged batches against FlexAttention document masks and padded SDPA",
          (("benchmarks/varlen_bench.py", "--out", "{out}/varlen.json"),), ("varlen.json",), "varlen"),
    Suite("decode", "KV-cache decode (contiguous and paged) against SDPA, FlexAttention and a device copy",
          (("benchmarks/decode_bench.py", "--out", "{out}/decode.json"),), ("decode.json",), "decode"),
    Suite("decode-form", "flashgen.attention with few query rows per kv head: its flash-decoding form and the "
          "forward kernels beside the decode kernel, SDPA cuDNN and a device copy, seqlen_q 1-64 (the form's "
          "rules, library.DECODE_FORM_RULES)",
          (("benchmarks/decode_bench.py", "--preset", "decode-form", "--backends",
            "flashgen,flashgen-attention,flashgen-attention-tiles,sdpa-cudnn,copy",
            "--out", "{out}/decode_form.json"),),
          ("decode_form.json",)),
    Suite("overhead", "host time per call on decode-like shapes against a raw launch and torch SDPA",
          (("benchmarks/overhead.py", "--out", "{out}/overhead.json"),), ("overhead.json",)),
    Suite("exactness", "the float64 matrix at GPU sizes and every search-space config, then the op under "
          "torch.compile, CUDA graphs and SDPA semantics, then the deterministic backward's bitwise repeatability",
          (("benchmarks/gpu_exactness.py", "--out", "{out}/exactness.json"), ("benchmarks/gpu_op_checks.py",),
           ("benchmarks/determinism.py", "--out", "{out}/determinism.json")),
          ("exactness.json", "determinism.json")),
    Suite("model", "a transformers model's training step with flashgen's attention against SDPA's",
          (("benchmarks/transformers_step.py", "--out", "{out}/model.json"),), ("model.json",),
          needs="benchmarks/transformers_step.py"),
    Suite("model-packed", "the same training step on packed documents (padding-free, 8 per batch entry): "
          "flashgen's ragged batch against SDPA reading the block-diagonal mask",
          (("benchmarks/transformers_step.py", "--packed", "8", "--out", "{out}/model_packed.json"),),
          ("model_packed.json",), needs="benchmarks/transformers_step.py"),
    Suite("fwd-configs", "forward tiles outside the tuning domain (BLOCK_M 256) and the pipelined forward "
          "(pipe_qk) against the tuned forward and cuDNN",
          (("benchmarks/probe_fwd_configs.py", "--out", "{out}/fwd_configs.json"),), ("fwd_configs.json",)),
    Suite("dq-atomic", "a single-pass backward with dQ atomics against the two-pass backward",
          (("benchmarks/probe_dq_atomic.py", "--out", "{out}/dq_atomic.json"),), ("dq_atomic.json",)),
    Suite("user-mods", "user-written score_mod / mask_mod functions and sinks against compiled FlexAttention "
          "with its BlockMask and the built-in equivalents",
          (("benchmarks/user_mods_bench.py", "--out", "{out}/user_mods.json"),), ("user_mods.json",)),
    Suite("profile", "where one call's time goes: wall vs GPU time per call and the kernels of one call, "
          "flashgen against SDPA cuDNN (--cprofile N: the host functions)",
          (("benchmarks/profile_call.py", "--out", "{out}/profile.json"),), ("profile.json",)),
    Suite("gluon", "the Gluon family's forward and backward variants (each checked against float64 first) "
          "against SDPA cuDNN / FlashAttention-2 and flashgen's Triton family",
          (("benchmarks/gluon_fwd.py", "--out", "{out}"), ("benchmarks/gluon_bwd.py", "--out", "{out}")),
          ("gluon_fwd.json", "gluon_bwd.json")),
    Suite("gluon-unchecked", "the head_dim 256 backward's variants the rules refuse until checked here or as "
          "measured slower (lookahead with atomic dQ, atomic dQ with TMA stores): float64 checks, then timings "
          "beside the default and cuDNN",
          (("benchmarks/gluon_bwd.py", "--wide", "--unchecked", "--budget-s", "400", "--out", "{out}"),),
          ("gluon_bwd_wide.json",)),
    Suite("gluon-user-bwd", "the Gluon backward's user score and mask functions (the default tile the "
          "dispatcher takes untuned): float64 checks in bf16 and float16, then timings beside the Triton "
          "family's backward of the same functions",
          (("benchmarks/gluon_user_bwd.py", "--out", "{out}"),), ("gluon_user_bwd.json",)),
    Suite("gluon-varlen", "the Gluon forward on ragged batches: its variants checked against float64, then timed "
          "beside the Triton family's varlen forward; the dispatcher's choice against each family's fastest row; "
          "both families' choices on the varlen suite's problems",
          (("benchmarks/gluon_varlen.py", "--out", "{out}"),
           ("benchmarks/gluon_varlen.py", "--time-only", "--out", "{out}/dispatcher"),
           ("benchmarks/gluon_varlen.py", "--suite-kernels", "--out", "{out}")),
          ("gluon_varlen.json", "dispatcher/gluon_varlen.json", "suite_kernels.json")),
    Suite("gluon-varlen-bwd", "the Gluon backward on ragged batches: its variants checked against float64, then "
          "timed beside the Triton family's varlen backward kernels and the dispatcher's choice; then, through the "
          "public call, which backward runs and whether it repeats bit for bit with and without "
          "torch.use_deterministic_algorithms",
          (("benchmarks/gluon_varlen_bwd.py", "--out", "{out}"), ("benchmarks/varlen_determinism.py",)),
          ("checks.json", "timings.json")),
)}

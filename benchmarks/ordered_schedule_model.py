"""A list-schedule model of the ordered (deterministic) Gluon backward's grid, on the CPU.

The model: one program per SM slot (``--sms``), each program a sequence of steps of unit
time (one (query head, query block) tile each: the query blocks its key block sees,
query heads outer, as the template's loop runs them), and one dQ add per step by the
program's writer, which waits for the program's previous add, for the same tile's add by
the previous rank of the chain (``bwd.ordered_program``'s 1-D grid, masked ranks taking
the key blocks last to first) and then takes ``--add`` steps; the consumers run at most
two tiles ahead of the writer (two staging buffers).  Programs start in grid order as
slots free up.  Memory is not modelled (no L2, no bandwidth), nor the dK/dV epilogue
beyond one step.

Prints per shape the makespan of the ordered grid at each HEAD_GROUP (power of two
dividing the pairs, and the launcher's rule ``bwd.ordered_head_group``) and of the
unordered grid in longest-first order, relative to the best ordered value, and the
ideal (total steps / SMs).  Shapes: causal, head_dim 128, the lock-step tile of 128 key
rows per program and 64-row query blocks (the shipped ordered rows at the Llama-3-8B
keys), the GQA group split as ``--shape B,H,HKV,S,GS``.

    python3 benchmarks/ordered_schedule_model.py [--shape B,H,HKV,S,GS]... [--sms 132] [--add 0.3]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.families.gluon import bwd as B  # noqa: E402

#: (batch, num_heads, num_kv_heads, seqlen, group_split): the three Llama-3-8B keys whose
#: deterministic backward was profiled (design.md, the ordered dQ), two more Llama-3-8B
#: keys and one of the dense grid's
SHAPES = ("1,32,8,1024,4", "2,32,8,1024,4", "8,32,8,1024,1", "1,32,8,2048,2", "4,32,8,2048,2", "16,16,16,1024,1")
#: The tile modelled: the lock-step ordered writer tile; its key rows per program and
#: query rows per block; the writer's staging buffers.
CONFIG = B.GluonBwdConfig(block_m=64, block_n=64, consumers=2, stages=2, dq_mode="ordered", dq_writer=True)
BLOCK_NT, BLOCK_M, SLOTS = CONFIG.block_nt, CONFIG.block_m, 2


def programs(pairs: int, seqlen: int, heads: int) -> dict:
    """(pair, key block) -> its tiles (query head, query block), causal."""
    n_kb, n_m = seqlen // BLOCK_NT, seqlen // BLOCK_M
    per = BLOCK_NT // BLOCK_M
    return {(p, n): [(g, m) for g in range(heads) for m in range(per * n, n_m)]
            for p in range(pairs) for n in range(n_kb)}


def makespan(order: list, progs: dict, sms: int, add: float, ordered: bool, seqlen: int) -> float:
    """End of the last program when ``order`` is launched onto ``sms`` slots."""
    per = BLOCK_NT // BLOCK_M
    n_kb = seqlen // BLOCK_NT
    done, free, end = {}, [0.0] * sms, 0.0
    for p, n in order:
        start = heapq.heappop(free)
        comp, adds = [], []
        for i, (g, m) in enumerate(progs[(p, n)]):
            ready = comp[-1] if comp else start
            if i >= SLOTS:
                ready = max(ready, adds[i - SLOTS])
            comp.append(ready + 1.0)
            a = comp[-1]
            if ordered:
                if n + 1 < n_kb and per * (n + 1) <= m:  # the previous rank adds into this tile too
                    a = max(a, done[(p, g, m, n + 1)])
                if adds:
                    a = max(a, adds[-1])
            adds.append(a + add)
            done[(p, g, m, n)] = adds[-1]
        fin = (adds[-1] if adds else start) + 1.0
        end = max(end, fin)
        heapq.heappush(free, fin)
    return end


def parse_shape(spec: str) -> tuple:
    try:
        b, h, hk, s, gs = (int(x) for x in spec.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {spec!r}: five integers B,H,HKV,S,GS") from None
    if min(b, h, hk, s, gs) < 1 or h % hk or (h // hk) % gs or s % BLOCK_NT:
        raise argparse.ArgumentTypeError(f"--shape {spec!r}: positive sizes, H a multiple of HKV, the group "
                                         f"(H / HKV) a multiple of GS, S a multiple of {BLOCK_NT}")
    return b, h, hk, s, gs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", type=parse_shape, default=None, help="B,H,HKV,S,GS (repeatable)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--add", type=float, default=0.3, help="an add's time, in steps")
    a = ap.parse_args()
    print("shape (B,H,HKV,S,GS) | pairs | programs | ideal / best | longest-first unordered / best | "
          "ordered by HEAD_GROUP / best (* the rule's)")
    for b, h, hk, s, gs in a.shape or [parse_shape(x) for x in SHAPES]:
        heads, pairs = h // hk // gs, b * hk * gs
        progs = programs(pairs, s, heads)
        n_kb = s // BLOCK_NT
        total = sum(len(t) for t in progs.values())
        lpt = makespan(sorted(progs, key=lambda k: -len(progs[k])), progs, a.sms, a.add, False, s)
        rule = B.ordered_head_group(CONFIG, pairs, s, heads, mask=True, sm_count=a.sms, seqlen_k=s)
        times = {}
        for hg in sorted({rule} | {1 << i for i in range(16) if (1 << i) <= pairs and pairs % (1 << i) == 0}):
            order = []
            for pid in range(n_kb * pairs):
                rank, pair = B.ordered_program(pid, n_kb * pairs, n_kb, hg)
                order.append((pair, n_kb - 1 - rank))
            times[hg] = makespan(order, progs, a.sms, a.add, True, s)
        best = min(times.values())
        cells = " ".join(f"{hg}{'*' if hg == rule else ''}:{t / best:.2f}" for hg, t in times.items())
        print(f"{b},{h},{hk},{s},{gs} | {pairs} | {n_kb * pairs} | {total / a.sms / best:.2f} | {lpt / best:.2f} | "
              f"{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Torch threads on a busy CPU: seconds per training-like step (a head-sized decoder layer and a 1,024-token
output, forward + backward + AdamW, 2 x 256 tokens) with N threads spinning (libgomp's default wait) or
waiting passively at OpenMP barriers, optionally beside one competing process pinned to the last CPU.

    python benchmarks/bench_threads.py [--competitor] [--rounds 2] [--steps 6]

Each setting runs in a fresh process (the wait policy is read when OpenMP starts), settings interleaved
round by round; the median step of each process is printed with the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

STEP = r"""
import sys, time, torch
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[1]))
H, S, V = 576, 256, 1024
layer = torch.nn.TransformerEncoderLayer(H, 9, 1536, batch_first=True)
head = torch.nn.Linear(H, V)
opt = torch.optim.AdamW(list(layer.parameters()) + list(head.parameters()), 1e-3)
x, y = torch.randn(2, S, H), torch.randint(0, V, (2, S))
def step():
    torch.nn.functional.cross_entropy(head(layer(x)).flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad()
for _ in range(3):
    step()
times = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
print(sorted(times)[len(times) // 2])
"""


def one(threads: int, policy: str | None, steps: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", STEP, str(threads), str(steps)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--competitor", action="store_true", help="one busy-looping process pinned to the last CPU")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    settings = [(len(cpus), None), (len(cpus), "PASSIVE"), (1, None)]
    rival = None
    if args.competitor:
        rival = subprocess.Popen(["taskset", "-c", str(cpus[-1]), sys.executable, "-c", "while True: pass"])
    try:
        seen = {s: [] for s in settings}
        for _ in range(args.rounds):
            for threads, policy in settings:
                seen[(threads, policy)].append(one(threads, policy, args.steps))
    finally:
        if rival is not None:
            rival.kill()
            rival.wait()
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    print(f"{len(cpus)} CPUs, competitor: {args.competitor}, load average after: {' '.join(load)}")
    for (threads, policy), values in seen.items():
        print(f"threads={threads} wait={policy or 'default (spin)'}: median step "
              f"{statistics.median(values) * 1000:.0f} ms (rounds: {', '.join(f'{v * 1000:.0f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

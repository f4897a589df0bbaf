"""A process that takes GPU memory away from a training run, from outside it: `python -m bench.gpu.hog`.

No code of the project runs in it and none is put into the run: it is another CUDA process on the same GPU, as a
neighbour's job would be. It reads one command a line on stdin and answers one line on stdout:

  cap BYTES   leave the others at most BYTES of the device: hold (total - BYTES - what this process's own context
              takes), in chunks of CHUNK, and go on taking any memory that is freed until it holds that much
              (a run that frees its cache after an OOM does not get it back); answers "held N" once it holds all
              of it or nothing more was freed for SETTLE_S
  free        release everything it holds ("held 0")
  quit        exit

The run sees allocations fail wherever its next one lands: at a random moment of a step when the command comes
at one.
"""

from __future__ import annotations

import select
import sys
import time

CHUNK = 64 * 1024**2
POLL_S = 0.02
SETTLE_S = 1.0


def main() -> int:
    import torch

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    held: list[torch.Tensor] = []
    target = 0  # bytes to hold
    settled_at: float | None = None
    answered = True
    own_context = total - free - torch.cuda.memory_reserved()  # includes the other processes' use at start
    print(f"ready total {total} free {free}", flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready:
            line = sys.stdin.readline()
            if not line:
                return 0
            cmd, *args = line.split()
            if cmd == "quit":
                return 0
            if cmd == "free":
                held.clear()
                torch.cuda.empty_cache()
                target = 0
                print("held 0", flush=True)
                continue
            if cmd == "cap":
                target = max(0, total - int(args[0]) - max(0, own_context))
                answered, settled_at = False, time.perf_counter()
        have = len(held) * CHUNK
        grew = False
        while have + CHUNK <= target:
            try:
                held.append(torch.empty(CHUNK, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
            have += CHUNK
            grew = True
        if grew:
            settled_at = time.perf_counter()
        if not answered and (have + CHUNK > target or time.perf_counter() - (settled_at or 0.0) > SETTLE_S):
            print(f"held {have}", flush=True)
            answered = True


if __name__ == "__main__":
    sys.exit(main())

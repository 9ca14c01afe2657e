"""A tiny ZeRO-2 training run for the fault tests (tests/test_faults.py), launched by `zerofit launch`.

12 optimizer steps (2 epochs of 6) of a small MLP with dropout, AdamW, a LambdaLR schedule and a
shuffling DataLoader, saving state every 4 steps with Accelerate's automatic checkpoint naming. It
resumes only through `checkpoint.resume` (nothing here loads a checkpoint). The per-step losses live in
an object registered for checkpointing, so the file rank 0 writes at the end holds every step once,
each with the attempt that computed it.

Faults, each on rank 1 only, on the first attempt only:
  --kill_step N   SIGKILL itself at step N, after that step's update
  --hang_step N   sleep inside step N (before backward), as a hung rank does
  --uneven        train on the script's own, unprepared DataLoader with one batch more on rank 0
  --sockets FILE  (no fault) rank 0 writes the listening sockets of the launcher and every worker, after
                  prepare() and before the first step; the run then trains as without it
  --own_init      the script creates the process group itself (torch's env:// rendezvous), before zerofit
  --main_only_save  after training, rank 0 alone calls accelerator.save_model (the others go on to the final
                  wait_for_everyone), as `if accelerator.is_main_process:` around a save does
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerofit import Accelerator
from zerofit.utils import ProjectConfiguration


class LossLog:
    """Loss of every optimizer step, and which attempt computed it (restored with the checkpoint)."""

    def __init__(self):
        self.losses: list[float] = []
        self.attempts: list[int] = []

    def state_dict(self):
        return {"losses": list(self.losses), "attempts": list(self.attempts)}

    def load_state_dict(self, sd):
        self.losses, self.attempts = list(sd["losses"]), list(sd["attempts"])


def listening_sockets(pid: int) -> list[str]:
    """'address:port' of every TCP socket in LISTEN state that process `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    found.append(f"{address}:{int(port, 16)}")
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save_every", type=int, default=4)
    p.add_argument("--kill_step", type=int, default=0)
    p.add_argument("--hang_step", type=int, default=0)
    p.add_argument("--uneven", action="store_true")
    p.add_argument("--sockets", default=None)
    p.add_argument("--own_init", action="store_true")
    p.add_argument("--main_only_save", action="store_true")
    args = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    if args.own_init:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=args.out,
                                                                  automatic_checkpoint_naming=True))
    rank = accelerator.process_index
    with open(os.path.join(args.out, f"pid-{attempt}-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    data = torch.randn(24, 9, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(data[:, :8], data[:, 8:]), batch_size=2, shuffle=True)
    own_loader = None
    if args.uneven:  # the script's own per-rank data, not prepared: rank 0 gets one batch more
        n = 4 + (rank == 0)
        own_loader = DataLoader(TensorDataset(data[:2 * n, :8], data[:2 * n, 8:]), batch_size=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    log = LossLog()
    accelerator.register_for_checkpointing(log)  # after prepare(), as Accelerate scripts do

    if args.sockets:
        dist.barrier()  # gloo's connections are up: every socket the run opens now exists
        pids = [None] * accelerator.num_processes
        dist.all_gather_object(pids, os.getpid())
        if rank == 0:
            report = {"launcher": listening_sockets(os.getppid()),
                      "workers": [s for pid in pids for s in listening_sockets(pid)],
                      "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
            with open(args.sockets, "w") as f:
                json.dump(report, f)
        accelerator.wait_for_everyone()

    step = accelerator.completed_steps
    epochs = -(-args.steps // len(loader))
    for _epoch in range(loader.iteration, epochs):
        for x, y in own_loader if own_loader is not None else loader:
            if step >= args.steps:
                break
            step += 1
            loss = nn.functional.mse_loss(model(x), y)
            if step == args.hang_step and rank == 1 and attempt == 0:
                with open(os.path.join(args.out, "hang-start"), "w") as f:
                    f.write(repr(time.time()))
                time.sleep(3600)  # hung inside the step: the other rank waits in the backward's collective
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            log.losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            log.attempts.append(attempt)
            if step % args.save_every == 0:
                accelerator.save_state()
            if step == args.kill_step and rank == 1 and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        if args.uneven:
            break
    if args.main_only_save and accelerator.is_main_process:
        accelerator.save_model(model, os.path.join(args.out, "model"))  # collective: the others never join
    accelerator.wait_for_everyone()
    if rank == 0:
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump({"losses": log.losses, "attempts": log.attempts, "completed_steps": accelerator.completed_steps,
                       "resumed_from": accelerator.resumed_from}, f)


if __name__ == "__main__":
    main()

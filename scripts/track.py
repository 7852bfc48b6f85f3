#!/usr/bin/env python3
"""track.py - follow a `dflash train` run's log.jsonl into TensorBoard or Weights & Biases.

    python3 scripts/track.py RUN --tensorboard DIR [--follow]
    python3 scripts/track.py RUN --wandb PROJECT [--name NAME] [--follow]

RUN is the run directory (RUN/log.jsonl) or the log itself. Every numeric field of a step line
is logged under train/ (loss, lr, grad_norm, tau_hat, tokens_per_s, step_s, mfu, mem_gib,
eta_s, ...; acc[k] as train/acc_k), every eval line under eval/ (eval_loss -> eval/loss,
eval_tau_walk -> eval/tau_walk, eval_acc[k] -> eval/acc_k), at the line's step. With --follow
it keeps reading the log as the run writes it (like tail -f) until the run's export appears
(RUN/export/model.safetensors newer than the start) or Ctrl-C; a resumed run rewrites the log
from its checkpoint's step on, and track.py then logs those steps again (TensorBoard keeps the
newest value of a step; W&B needs increasing steps, so steps it has already seen are skipped).

TensorBoard: torch.utils.tensorboard or tensorboardX, whichever is installed. W&B: wandb. Neither
is a dependency of dflash; asking for one that is not installed is an error naming the package.
Python 3.9+ standard library otherwise. Exit codes: 0 ok, 1 bad input or missing package, 2
bad usage.
"""

import argparse
import json
import math
import os
import sys
import time


def die(msg, code=1):
    print(f"track.py: {msg}", file=sys.stderr)
    sys.exit(code)


def scalars(rec):
    """(prefix, {name: value}) of one log record, or None for a record without a step."""
    step = rec.get("step")
    if not isinstance(step, int) or isinstance(rec.get("run"), dict):  # the run lines: metadata
        return None
    is_eval = any(k.startswith("eval_") for k in rec)
    prefix = "eval" if is_eval else "train"
    out = {}
    for k, v in rec.items():
        if k == "step":
            continue
        name = k[5:] if is_eval and k.startswith("eval_") else k
        if isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                    out[f"{name}_{i + 1}"] = float(x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[name] = float(v)
    return prefix, step, out


class TensorBoard:
    def __init__(self, logdir):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                die("--tensorboard needs torch (torch.utils.tensorboard) or tensorboardX: "
                    "pip install tensorboard, or tensorboardX")
        self.w = SummaryWriter(logdir)

    def log(self, prefix, step, vals):
        for k, v in vals.items():
            self.w.add_scalar(f"{prefix}/{k}", v, step)

    def flush(self):
        self.w.flush()

    def close(self):
        self.w.close()


class WandB:
    def __init__(self, project, name, run_dir):
        try:
            import wandb
        except ImportError:
            die("--wandb needs the wandb package: pip install wandb")
        self.wandb = wandb
        cfg = {}
        hp = os.path.join(run_dir, "export", "config.json")
        if os.path.isfile(hp):
            try:
                cfg = json.load(open(hp))
            except (OSError, ValueError):
                cfg = {}
        self.run = wandb.init(project=project, name=name, config=cfg)
        self.last = -1

    def log(self, prefix, step, vals):
        if step < self.last or (step == self.last and prefix == "train"):
            return  # W&B's steps only increase
        self.last = step
        self.run.log({f"{prefix}/{k}": v for k, v in vals.items()}, step=step)

    def flush(self):
        pass

    def close(self):
        self.run.finish()


def follow_lines(path, follow, done):
    """Complete lines of path as they appear; restarts when the file is rewritten (a resumed
    run's trim) or shrinks."""
    pos, ino, partial = 0, None, ""
    while True:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if not follow:
                die(f"{path}: no such file")
            time.sleep(1)
            continue
        if ino is not None and (st.st_ino != ino or st.st_size < pos):
            pos, partial = 0, ""  # rewritten: read it again from the start
        ino = st.st_ino
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            f.seek(pos)
            chunk = f.read()
            pos = f.tell()
        text = partial + chunk
        lines = text.split("\n")
        partial = lines.pop()  # an unfinished last line waits for its newline
        for ln in lines:
            yield ln
        if not follow or done():
            return
        time.sleep(1)


def main():
    ap = argparse.ArgumentParser(description="Follow a dflash run's log.jsonl into TensorBoard "
                                 "or Weights & Biases.")
    ap.add_argument("run", help="the run directory, or its log.jsonl")
    ap.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard event files to DIR")
    ap.add_argument("--wandb", metavar="PROJECT", help="log to this W&B project")
    ap.add_argument("--name", help="the W&B run name (default: the run directory's name)")
    ap.add_argument("--follow", action="store_true",
                    help="keep reading as the run writes, until its export appears or Ctrl-C")
    a = ap.parse_args()
    if bool(a.tensorboard) == bool(a.wandb):
        die("give one of --tensorboard DIR or --wandb PROJECT", 2)
    path = a.run
    run_dir = a.run
    if os.path.isdir(path):
        path = os.path.join(path, "log.jsonl")
    else:
        run_dir = os.path.dirname(os.path.abspath(path))
    if not a.follow and not os.path.isfile(path):
        die(f"{path}: no such file")
    sink = (TensorBoard(a.tensorboard) if a.tensorboard
            else WandB(a.wandb, a.name or os.path.basename(os.path.abspath(run_dir)), run_dir))
    t0 = time.time()
    export = os.path.join(run_dir, "export", "model.safetensors")

    def done():
        try:
            return os.stat(export).st_mtime >= t0
        except FileNotFoundError:
            return False

    n, bad = 0, 0
    try:
        for i, ln in enumerate(follow_lines(path, a.follow, done), 1):
            if not ln.strip():
                continue
            try:
                rec = json.loads(ln)
            except ValueError:
                bad += 1
                print(f"track.py: {path}: line {i}: not JSON, skipped", file=sys.stderr)
                continue
            s = scalars(rec) if isinstance(rec, dict) else None
            if s is None:
                bad += 1
                continue
            sink.log(*s)
            n += 1
            if n % 100 == 0:
                sink.flush()
    except KeyboardInterrupt:
        pass
    sink.flush()
    sink.close()
    print(f"track.py: {n} records from {path}" + (f" ({bad} skipped)" if bad else ""))
    if n == 0:
        sys.exit(1)


if __name__ == "__main__":
    main()

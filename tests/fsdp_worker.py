"""Run under torchrun by tests/test_fsdp.py: trains each job of a JSON list with attnlab.train.loop.train.

    torchrun --nproc_per_node N tests/fsdp_worker.py jobs.json

Each job: {"model": {...}, "data": {...}, "train": {...}, "run_dir": "...", "stop_at": step or null}. stop_at ends
the job (on every process) right after the checkpoint of that step is saved, as an interruption would.
"""

import json
import sys
from pathlib import Path

import attnlab
from attnlab.config import DataConfig, TrainConfig
from attnlab.errors import AttnlabError
from attnlab.train import loop


class Stopped(Exception):
    pass


def main(path: str) -> int:
    jobs = json.loads(Path(path).read_text())
    real_barrier = loop.barrier
    for job in jobs:
        run_dir, stop = Path(job["run_dir"]), job.get("stop_at")

        def barrier(info, stop_at=stop, run_dir=run_dir):
            real_barrier(info)  # after a save: its pointer is written
            pointer = run_dir / "checkpoints" / "last.json"
            if stop_at is not None and pointer.exists() and json.loads(pointer.read_text())["step"] == stop_at:
                raise Stopped

        loop.barrier = barrier
        try:
            loop.train(
                attnlab.model_config_from_dict(job["model"]),
                DataConfig(**job["data"]),
                TrainConfig(**job["train"]),
                run_dir,
                progress=False,
            )
        except Stopped:
            pass
        except AttnlabError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

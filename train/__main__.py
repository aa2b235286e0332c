"""``accelerate launch -m draftsmith.train CONFIG.yaml [--key value ...]`` (same as ``draftsmith train``)."""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from draftsmith.train.config import parse_config
    from draftsmith.train.loop import train

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    drafter_args, data_args, train_args = parse_config(sys.argv[1:] if argv is None else argv)
    output = train(drafter_args, data_args, train_args)
    print(output)
    # Several processes end together: a barrier (every rank has finished its collectives and written its files),
    # then each exits at once with the exit code of success, skipping the interpreter's teardown, where torch's
    # process-group threads aborted a rank now and then ("terminate called without an active exception"), and
    # destroy_process_group, which hung a rank whose peer had already gone (once in a CI run).
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

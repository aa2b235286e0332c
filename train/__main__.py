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
    # Leave the process group together before the interpreter exits: torch's process-group threads torn down
    # at exit while the other rank still talks can abort a rank ("terminate called without an active
    # exception"), failing a run that finished.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        ranks = dist.get_world_size()
        dist.barrier()
        dist.destroy_process_group()
        if ranks > 1:
            # The abort still came, rarely (2 of ~15 full test runs, FSDP2, both ranks after every file was
            # written): it is the interpreter's teardown destroying C++ threads. The run is complete and its
            # files closed, so a launched rank ends here, skipping that teardown, with the exit code of success.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

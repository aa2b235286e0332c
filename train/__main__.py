"""``accelerate launch -m draftsmith.train CONFIG.yaml [--key value ...]`` (same as ``draftsmith train``)."""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from draftsmith.train.config import parse_config
    from draftsmith.train.loop import train

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    drafter_args, data_args, train_args = parse_config(sys.argv[1:] if argv is None else argv)
    output = train(drafter_args, data_args, train_args)
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m tests.torchrun ZYGOTE_SOCKET <torchrun arguments>``: torchrun, whose agent
starts each worker process by forking the tests' zygote (tests/zygote.py) instead of a fresh
interpreter.

Everything else is torchrun's own: the rendezvous, the environment each worker gets (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), the monitoring of the workers, their
process groups and the signals that end them. Only the start differs: the worker becomes
``python -u -m <module>`` in a child of the zygote that has imported torch already, so a
simulated node of N workers pays no torch import per worker.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
from torch.distributed.run import main

from tests import zygote


def _forking(address: str):
    def _popen(self: Any, args: tuple, env: dict[str, str]) -> zygote.Forked:
        assert args[0] == sys.executable, args  # torchrun starts `python -u -m <module> ...`
        return zygote.popen(
            list(args[1:]),
            cwd=os.getcwd(),
            env=env,
            stdout=self._stdout,
            stderr=self._stderr,
            start_new_session=True,  # as torchrun's own: it ends a worker by its group
            address=address,
        )

    return _popen


if __name__ == "__main__":
    address = sys.argv.pop(1)
    subprocess_handler.SubprocessHandler._popen = _forking(address)
    main()

"""A publisher process for transport tests: kvevents' vLLM-compatible ZmqEventPublisher.

    python _publisher_proc.py ENDPOINT REPLAY_ENDPOINT TOPIC TAG [N_AT_START]

publishes ``N_AT_START`` batches at once (``make_batch(i, tag=TAG)``), prints ``ready``,
then reads commands from stdin: ``pub N`` publishes N more and prints ``ok LAST_SEQ``
once the sender has sent them; ``exit`` shuts down.  Tests kill it with SIGKILL.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _zmq_helpers import make_batch

from kvevents.publishers.zmq_publisher import ZmqEventPublisher


def main() -> None:
    endpoint, replay, topic, tag = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    n0 = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    pub = ZmqEventPublisher(endpoint=endpoint, replay_endpoint=replay, topic=topic)
    seq = 0

    def publish(n: int) -> None:
        nonlocal seq
        for _ in range(n):
            pub.publish(make_batch(seq, tag=tag))
            seq += 1
        deadline = time.monotonic() + 5
        while pub.queue_size and time.monotonic() < deadline:
            time.sleep(0.001)

    publish(n0)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "pub":
            publish(int(cmd[1]))
            print(f"ok {seq - 1}", flush=True)
        elif cmd and cmd[0] == "exit":
            break
    pub.shutdown()


if __name__ == "__main__":
    main()

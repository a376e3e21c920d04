"""Host proxy drain rate on the CPU: the native (C++) loop against the Python one, same FIFO.

A producer thread plays the GPU: it pushes commands with the GPU's protocol (compare-and-swap
claim on ``head``, body, release-store of the header) from native code with the GIL released,
so it is never the bottleneck. The proxy drains them through a transport:
  inprocess - host memmove into the peer's buffer + an atomic add on its event counter;
  tcp       - frames over a loopback socket to a TcpTransport receiver in this process.
Tiles are scattered (no two neighbours adjacent: one transfer per command) or adjacent rows
(merged up to the batch of 8). Reported: commands/s and payload GB/s. Target (issue 6): the
native loop drains >= 200 k commands/s.

Run: python benchmarks/bench_proxy_cpu.py [--out benchmarks/results] [--quick]
Writes bench_proxy_cpu.json (rows {bench, proxy, transport, tile_bytes, order, batch, commands,
seconds, commands_per_s, gb_per_s}) and a markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mgraph.runtime.proxy import (
    Command,
    CommandFifo,
    InProcessTransport,
    NativeProxy,
    Proxy,
    Rect,
    TcpTransport,
)
from mgraph.runtime.proxy.command import encode
from mgraph.runtime.proxy.native import load
from mgraph.topology import Topology

EVENTS = 1024
COLS = 64  # float32: a row is 256 bytes


class World:
    """Rank 0 sends to rank 1 (topology 2x1) through ``transport``."""

    def __init__(self, transport: str, rows: int) -> None:
        self.buffers = {r: {0: torch.randn(rows, COLS)} for r in (0, 1)}
        self.counters = {r: torch.zeros(EVENTS, dtype=torch.int64) for r in (0, 1)}
        self.arrived = 0
        topo = Topology.parse("2x1")
        self.transports = []
        if transport == "inprocess":
            t = InProcessTransport(self._arrive, topo)
            for r in (0, 1):
                t.register(r, self.buffers[r])
            t.connect(0, 1)
            self.sender = t
        else:
            store = dist.HashStore()
            ends = {r: TcpTransport(store, self._arrive, topo, [r], timeout=60) for r in (0, 1)}
            for r in (0, 1):
                ends[r].register(r, self.buffers[r], n_events=EVENTS)
            dial = threading.Thread(target=ends[0].connect, args=(0, 1))
            dial.start()
            ends[1].connect(1, 0)
            dial.join()
            self.sender = ends[0]
            self.transports = list(ends.values())

    def _arrive(self, rank: int, event: int, epoch: int) -> None:
        self.arrived += 1

    def close(self) -> None:
        for t in self.transports:
            t.close()


def bodies(tile_rows: int, n_tiles: int, order: str) -> list[list[int]]:
    """Encoded WRITE commands of ``n_tiles`` row tiles, in an order that merges or does not."""
    idx = list(range(n_tiles))
    if order == "scattered":  # stride 2 through the buffer: neighbours are never adjacent
        idx = idx[::2] + idx[1::2]
    nbytes = tile_rows * COLS * 4
    return [
        encode(
            Command.write(
                0,
                Rect(0, i * tile_rows, (i + 1) * tile_rows, 0, COLS),
                1,
                Rect(0, i * tile_rows, (i + 1) * tile_rows, 0, COLS),
                bytes=nbytes,
                event=i % EVENTS,
                epoch=1,
            ),
            1,
        )
        for i in idx
    ]


def measure(
    proxy_kind: str, transport: str, tile_rows: int, order: str, count: int, batch: int = 8
) -> dict:
    native = load()
    n_tiles = max(2, min(256, (64 << 20) // (tile_rows * COLS * 4)))
    world = World(transport, n_tiles * tile_rows)
    fifo = CommandFifo(1024, timeout=120)
    if proxy_kind == "native":
        proxy = NativeProxy(
            fifo, world.sender, batch, rank=0, counters=world.counters, timeout=120, idle_sleep_us=5
        )
    else:
        proxy = Proxy(fifo, world.sender, batch, timeout=120)
    cmds = bodies(tile_rows, n_tiles, order)
    ptrs = (fifo.ring.data_ptr(), fifo.head.data_ptr(), fifo.tail.data_ptr(), fifo.capacity)
    proxy.start()
    start = time.perf_counter()
    producer = threading.Thread(target=native.produce, args=(*ptrs, cmds, count, 120.0))
    producer.start()
    producer.join()
    proxy.stop()
    seconds = time.perf_counter() - start
    if transport == "tcp":  # until the receiver took the last frame
        while world.arrived < count:
            time.sleep(1e-4)
        seconds = time.perf_counter() - start
    assert fifo.tail_value == count
    world.close()
    nbytes = tile_rows * COLS * 4
    return {
        "bench": "proxy_drain",
        "proxy": proxy_kind,
        "transport": transport,
        "tile_bytes": nbytes,
        "order": order,
        "batch": batch,
        "commands": count,
        "seconds": round(seconds, 4),
        "commands_per_s": round(count / seconds),
        "gb_per_s": round(count * nbytes / seconds / 1e9, 3),
        "transfers": proxy.stats.writes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--quick", action="store_true", help="fewer commands (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scale = 10 if args.quick else 1
    rows = []
    plan = [
        # (proxy, transport, tile rows, order, commands)
        ("native", "inprocess", 1, "scattered", 1_000_000),
        ("native", "inprocess", 1, "adjacent", 1_000_000),
        ("native", "inprocess", 16, "scattered", 400_000),
        ("native", "inprocess", 256, "scattered", 100_000),
        ("native", "inprocess", 1024, "scattered", 20_000),
        ("python", "inprocess", 1, "scattered", 30_000),
        ("python", "inprocess", 1, "adjacent", 30_000),
        ("python", "inprocess", 256, "scattered", 20_000),
        ("native", "tcp", 1, "scattered", 200_000),
        ("native", "tcp", 256, "scattered", 20_000),
        ("python", "tcp", 1, "scattered", 20_000),
        ("python", "tcp", 256, "scattered", 10_000),
    ]
    for proxy, transport, tile_rows, order, count in plan:
        row = measure(proxy, transport, tile_rows, order, max(1000, count // scale))
        print(json.dumps(row))
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "bench": "meta",
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }
    (out / "bench_proxy_cpu.json").write_text(json.dumps([meta, *rows], indent=1) + "\n")
    lines = [
        "| proxy | transport | tile | order | commands/s | GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['proxy']} | {r['transport']} | {r['tile_bytes'] // 1024 or r['tile_bytes']}"
            f"{' KiB' if r['tile_bytes'] >= 1024 else ' B'} | {r['order']} | "
            f"{r['commands_per_s']:,} | {r['gb_per_s']} |"
        )
    (out / "bench_proxy_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

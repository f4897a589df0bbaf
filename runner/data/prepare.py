"""Rendering many chats to token arrays: in chunks, over a pool of processes when there are many.

A tokenizer's `render_batch` turns a chunk of chats into (ids, flags) arrays at once, its `render_texts` a chunk of
raw documents (`data.format: text`, a chat given as a string: every token a target) (the byte tokenizer
from each chat's UTF-8 bytes, transformers' fast tokenizers one batched call per chunk). `ChunkRenderer`
hands out chunks in order and gives back each chunk's records in the same order, chats truncated to the row
limit (raw documents whole: they are cut into blocks when loaded), rendered either in this process or, once a
source shows itself large (POOL_AFTER records), by worker processes, one per core: the reader keeps parsing
records while the workers tokenize, and the result is the same ids and flags whichever way a chunk went.

Workers are forked where the platform can (Linux): they start in milliseconds, share the parent's pages
copy-on-write and need no importable main module (`spawn` re-runs the caller's script in each worker, and
pays 1-3 s of imports); they only run the tokenizer and numpy, never torch or CUDA, whatever the parent
holds. The tokenizer goes to them once, as built here; the Rust tokenizer's own threads are turned off in
them (a worker per core already).
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np

from runner.data.pairs import PROMPT_TURN
from runner.data.tokenizer import Message, Tokenizer, segment_arrays

CHUNK_RECORDS = 512  # chats per render_batch call (one batched tokenizer call; a few MB in flight)
POOL_AFTER = 8 * CHUNK_RECORDS  # fewer records tokenize in well under a second here: no workers
Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]  # (ids, flags, lengths): the chunk's records end to end
Chat = Sequence[Message] | str  # a chat, or a raw document (data.format: text)


def render_chunk(tokenizer: Tokenizer, chats: Sequence[Chat], limit: int) -> Chunk:
    """The chats rendered and each truncated to `limit` tokens, raw documents whole, joined end to end, with their
    lengths."""
    docs = [k for k, c in enumerate(chats) if isinstance(c, str)]
    if len(docs) == len(chats):  # a text source's chunk
        rendered = tokenizer.render_texts(chats)  # type: ignore[arg-type]
    elif not docs:
        batch = getattr(tokenizer, "render_batch", None)
        rendered = batch(chats) if batch is not None else [segment_arrays(tokenizer.render(m)) for m in chats]
    else:  # never from one source (its first record fixes its format); kept in order all the same
        rendered = [render_chunk_one(tokenizer, c) for c in chats]
    # A raw document stays whole: cut into blocks of a row when loaded (runner/data/tokens.py `Blocks`), not truncated.
    pairs = list(zip(chats, rendered, strict=True))
    ids = [i if isinstance(c, str) else i[:limit] for c, (i, _) in pairs]
    flags = [f if isinstance(c, str) else unscore_prompt_turns(c, f)[:limit] for c, (_, f) in pairs]
    lengths = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0, bool), lengths
    return np.concatenate(ids).astype(np.int64, copy=False), np.concatenate(flags).astype(bool, copy=False), lengths


def unscore_prompt_turns(chat: Chat, flags: np.ndarray) -> np.ndarray:
    """`flags` without the targets of a preference pair's prompt turns (assistant messages marked PROMPT_TURN,
    runner/data/pairs.py): they come first, each one run of targets (its reply and end-of-turn), so every target
    before the completion's first run is cleared."""
    if isinstance(chat, str):
        return flags
    turns = sum(1 for m in chat if isinstance(m, dict) and m.get(PROMPT_TURN))
    if not turns:
        return flags
    starts = np.flatnonzero(flags & ~np.concatenate(([False], flags[:-1])))  # where each run of targets begins
    out = flags.copy()
    out[: starts[turns] if turns < len(starts) else len(out)] = False
    return out


def render_chunk_one(tokenizer: Tokenizer, chat: Chat) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(chat, str):
        return tokenizer.render_texts([chat])[0]
    return segment_arrays(tokenizer.render(chat))


def usable_cpus() -> int:
    """The cores this process may run on (its affinity, which a container's cpuset limits)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_worker_tokenizer: Tokenizer | None = None  # set once in each worker process by _start_worker


def _start_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    # Each worker tokenizes its own chunk: the Rust tokenizer's thread pool on top would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = tokenizer


def _render_in_worker(chats: Sequence[Chat], limit: int) -> Chunk:
    assert _worker_tokenizer is not None, "the worker's initializer sets the tokenizer"
    return render_chunk(_worker_tokenizer, chats, limit)


class ChunkRenderer:
    """Renders chunks of chats in the order given; `put` a chunk, iterate `ready()` for finished ones.

    In process until POOL_AFTER records went by on a machine with 2 or more cores, then over `workers`
    processes with at most 2 chunks a worker in flight (bounded memory: the reader waits for the oldest).
    """

    def __init__(self, tokenizer: Tokenizer, limit: int, workers: int | None = None):
        self.tokenizer, self.limit = tokenizer, limit
        self.workers = usable_cpus() if workers is None else workers
        self.seen = 0
        self._pool: ProcessPoolExecutor | None = None
        self._pending: deque[tuple[object, Future[Chunk] | Chunk | ValueError]] = deque()

    def __enter__(self) -> ChunkRenderer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def put(self, chats: list[Chat], tag: object = None) -> None:
        """Queue a chunk; `tag` comes back with it (what the caller needs to name a record in an error)."""
        self.seen += len(chats)
        if self._pool is None and self.workers > 1 and self.seen > POOL_AFTER:
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=context, initializer=_start_worker, initargs=(self.tokenizer,)
            )
        if self._pool is not None:
            self._pending.append((tag, self._pool.submit(_render_in_worker, chats, self.limit)))
            return
        try:
            self._pending.append((tag, render_chunk(self.tokenizer, chats, self.limit)))
        except ValueError as err:  # a message the tokenizer refuses: the caller finds which
            self._pending.append((tag, err))

    def ready(self, drain: bool = False) -> Iterator[tuple[object, Chunk | ValueError]]:
        """(tag, rendered chunk or the ValueError it raised) in order: all when `drain`, else the finished ones
        and any past the in-flight bound."""
        while self._pending and (drain or len(self._pending) > 2 * self.workers or not _running(self._pending[0][1])):
            tag, head = self._pending.popleft()
            if isinstance(head, Future):
                try:
                    head = head.result()
                except ValueError as err:
                    head = err
            yield tag, head


def _running(item: object) -> bool:
    return isinstance(item, Future) and not item.done()

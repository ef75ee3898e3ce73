"""Every Redis key shape, built in one place.

Ids are client-controlled strings that may hold ``:``, glob characters, spaces or
non-ASCII. Each component is percent-encoded (``quote(x, safe="")``) so an encoded
component is made only of ``A-Z a-z 0-9 _ . - ~ %``: it can never contain the ``:``
separator (no collisions: book ``a:b`` + chapter ``c`` differs from book ``a`` +
chapter ``b:c``) nor a glob character (a ``SCAN MATCH`` on a book prefix never
widens to another book).

| key                                          | type   | lifetime                                  |
| -------------------------------------------- | ------ | ----------------------------------------- |
| ``P:cancel:B``                               | string | until the next regenerate of book B       |
|   (``stop``: a Stop All's; ``1``: a mirror of |        |                                           |
|   B's tombstone: reconcile, or a regenerate   |        |                                           |
|   that was refused)                           |        |                                           |
| ``P:lifting:B`` (members: request ids, score | zset   | a regenerate's lift of B's cancel flag,   |
|   = when the lift counts as over)             |        | until its commands are written (5 min max)|
| ``P:force:B``  (members ``C:S:STAGE``)        | set    | force TTL (120 s) after a regenerate      |
| ``P:defer:B:BUCKET`` (members ``C:S:STAGE``,  | zset   | score = expiry time; pruned by reconcile, |
|   score = deferral expiry, unix seconds)      |        | gone with the cancel or once B is idle;   |
|                                               |        | TTL: its last write's deferral + 60 s     |
| ``P:active-books`` (members ``B``)            | set    | while the book has active scenes          |
| ``P:active:B`` (members ``C:S``)              | set    | while a scene has queued or running work  |
| ``P:active-books:due`` (members ``B``, score  | zset   | while B has pending work; the tick takes  |
|   = when B next needs a gate pass, unix s)    |        | the entries that are due                  |
| ``P:active-books:due:held`` (members          | zset   | while a batch or a regenerate runs B's    |
|   ``HOLDER:B``, score = when the hold lapses) |        | pass; the tick takes lapsed ones          |
| ``P:active-books:due:lapses`` (B -> count)    | hash   | from B's lost pass until a pass of B ends |
| ``P:lease:B:C:S:STAGE``                       | string | queued: as long as ``P:queued:ID``; from  |
|                                               |        | the job's start the stage's lease TTL,    |
|                                               |        | renewed by the job (domain/liveness.py)   |
| ``P:dispatch:ID``                             | hash   | dispatch metadata, read at the job's      |
|                                               |        | start; deleted as its end frees the slot  |
|                                               |        | (lane_take.lua), else 4 queued lease TTLs |
|                                               |        | (revoked, taken over)                     |
| ``P:running:ID``                              | string | lease TTL while a delivery of ID runs     |
| ``P:queued:ID`` (value: dispatch time)        | string | from dispatch to its first delivery       |
|                                               |        | (at most 24 h; see domain/liveness.py)    |
| ``P:handing:ID`` (value: books to go)        | string | one hand-over of a lane's slots to several |
|                                               |        | books, until the last one's refill is done |
|                                               |        | (at most 10 minutes)                      |
| ``P:superseded:ID``                           | string | a forced regenerate fenced dispatch ID    |
|                                               |        | off: its pair's re-run keeps the slot;    |
|                                               |        | the visibility timeout                    |
| ``P:consumers:QUEUE`` (members hostname,      | zset   | heartbeat TTL per member (a few seconds)  |
|   score = heartbeat expiry)                   |        |                                           |
| ``P:held:QUEUE`` (members hostname,           | zset   | heartbeat TTL per member, while the       |
|   score = heartbeat expiry)                   |        | worker beats for QUEUE with no consumer   |
|                                               |        | on it (draining its jobs, reconnecting)   |
| ``P:lane-waiters:QUEUE`` (members ``B``,      | zset   | until the book is handed a free slot of   |
|   score = priority rank x 1e10 + when B first |        | the lane (most urgent, then oldest first: |
|   waited for the lane)                        |        | round robin)                              |
| ``P:lane-handed:QUEUE`` (field ``B``, value: | hash   | from a hand-over of a slot of the lane to |
|   when B was handed it, Redis time, and B's   |        | B until B's refill claims or is done; put |
|   wait score then)                            |        | back on the list by a tick if it is lost  |
| ``P:lanes-seen-free`` (field QUEUE, value:     | hash   | while the lane has free slots and books   |
|   when the tick first saw that lane with free |        | waiting (a tick hands them on when it     |
|   slots and books waiting, Redis time)        |        | sees them again: lua/lanes_stranded.lua)  |
| ``P:breaker:QUEUE``                           | hash   | until closed again                        |
| ``P:breaker-host:QUEUE:NODE`` (value: NODE's  | string | until NODE runs a job of QUEUE well; a    |
|   failed runs of QUEUE in a row)              |        | day after its last failure                |
| ``P:stage-limits`` (JSON: each stage's queue | string | rewritten by each control worker's        |
|   and limits, as its ANIMASTOR_STAGES says)   |        | heartbeat; an hour after the last         |
| ``P:lock:NAME``                               | string | short singleton locks (tick, reconcile)   |
| ``P:bookmark:NAME``                           | string | where a task's round goes on (reconcile:  |
|                                               |        | the last book it passed); no expiry       |
| ``P:metrics``                                 | hash   | counters for the exporter; no expiry      |
| ``P:metrics-batch:ID``                        | string | marks a flushed counter batch applied, so |
|                                               |        | a resend adds nothing; a few minutes      |
| ``P:epoch``                                   | string | a random token set once per Redis dataset |
|                                               |        | (a process that sees it change knows      |
|                                               |        | Redis lost its data); no expiry           |

``P`` is the configured key prefix (``ANIMASTOR_KEY_PREFIX``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import quote, unquote

from animastor_tasks.domain.vocabulary import DeferralBucket

SEP = ":"
DEFER_BUCKETS: tuple[str, ...] = tuple(DeferralBucket)


_unquoted = re.compile(r"[A-Za-z0-9_.~-]*").fullmatch  # what `quote(..., safe="")` leaves as it is


@lru_cache(maxsize=65536)
def encode(component: str) -> str:
    """Percent-encode one id so it holds neither the separator nor a glob character.

    Cached: a pass names the same chapter, scene and stage ids in many keys and members."""
    return quote(component, safe="")


def encode_once(component: str) -> str:
    """`encode` for an id new each time (a dispatch, a batch, a hold's holder): never cached. *Why:* cached, each
    stayed, up to the cache's 65,536 entries (a GPU pool process grew 0.3 kB a job, 18 MB at the full cache)."""
    return component if _unquoted(component) else quote(component, safe="")


def decode(component: str) -> str:
    return unquote(component) if "%" in component else component  # most ids need no unquoting: skip its cost


@dataclass(frozen=True)
class Keyspace:
    prefix: str = "animastor"

    def _key(self, kind: str, *components: str) -> str:
        return SEP.join((self.prefix, kind, *(encode(c) for c in components)))

    def _key_once(self, kind: str, component: str) -> str:
        """The key of an id new each time (`encode_once`)."""
        return SEP.join((self.prefix, kind, encode_once(component)))

    # -- per book ---------------------------------------------------------
    def cancel_flag(self, book: str) -> str:
        return self._key("cancel", book)

    def stops_sent(self) -> str:
        """When each book's latest Stop All was sent, by its stamp (zset: book -> unix seconds)."""
        return self._key("stops-sent")

    def voided(self) -> str:
        """The regenerates found void (sent before a Stop All taken first): zset request id -> when."""
        return self._key("voided-requests")

    def lifting(self, book: str) -> str:
        """The regenerates lifting the book's cancel flag whose commands are not written yet (see `BookState`)."""
        return self._key("lifting", book)

    def force_set(self, book: str) -> str:
        return self._key("force", book)

    def deferrals(self, book: str, bucket: str) -> str:
        if bucket not in DEFER_BUCKETS:
            raise ValueError(f"unknown deferral bucket {bucket!r}")
        return SEP.join((self.prefix, "defer", encode(book), bucket))

    def pass_asked(self, book: str) -> str:
        """A refill sent the book's pass moments ago (`refill._pass_now`): the others of that moment send none."""
        return self._key("pass-asked", book)

    def active_scenes(self, book: str) -> str:
        return self._key("active", book)

    def active_books(self) -> str:
        return self._key("active-books")

    def due(self) -> str:
        """The due index: which books need a gate pass, and from when (the tick visits only those)."""
        return self._key("active-books", "due")

    def held_pass_lapses(self) -> str:
        """Book -> how many of its held passes lapsed in a row (their holder's process died each time)."""
        return self._key("active-books", "due", "lapses")

    def held_passes(self) -> str:
        """The passes a running gate batch or regenerate holds: `held_pass_member` -> when the hold lapses."""
        return self._key("active-books", "due", "held")

    # -- per scene x stage --------------------------------------------------
    def lease(self, book: str, chapter: str, scene: str, stage: str) -> str:
        return self._key("lease", book, chapter, scene, stage)

    def parse_lease(self, key: str) -> tuple[str, str, str, str]:
        """Inverse of `lease`: the (book, chapter, scene, stage) a lease key names."""
        head = f"{self.prefix}{SEP}lease{SEP}"
        if not key.startswith(head):
            raise ValueError(f"{key!r} is not a lease key of prefix {self.prefix!r}")
        parts = key[len(head) :].split(SEP)
        if len(parts) != 4:
            raise ValueError(f"{key!r} does not have four components")
        book, chapter, scene, stage = (decode(p) for p in parts)
        return book, chapter, scene, stage

    def dispatch(self, dispatch_id: str) -> str:
        return self._key_once("dispatch", dispatch_id)

    def running(self, dispatch_id: str) -> str:
        return self._key_once("running", dispatch_id)

    def abandoned(self, dispatch_id: str) -> str:
        """A job let go of as its process died (`lua/abandon_delivery.lua`): its lease is never taken back by it."""
        return self._key_once("abandoned", dispatch_id)

    def holding(self, holder: str) -> str:
        """What one worker process runs now (`liveness.delivery_holder`): a dead process's job is found by it."""
        return self._key("holding", holder)

    def holders(self, node: str) -> str:
        """The holders a worker's processes have been (one per pool process): what its next start lets go of."""
        return self._key("holders", node)

    def handing(self, batch: str) -> str:
        """How many books handed slots together (`lanes.hand_over`) have not yet had their refill."""
        return self._key_once("handing", batch)

    def superseded(self, dispatch_id: str) -> str:
        """Set when a forced regenerate fences the dispatch off: the takeover gives its pair's slot to the re-run."""
        return self._key_once("superseded", dispatch_id)

    def queued(self, dispatch_id: str) -> str:
        """The undelivered marker of a dispatch: set with its lease, removed by its first delivery."""
        return self._key_once("queued", dispatch_id)

    # -- per queue ------------------------------------------------------------
    def consumers(self, queue: str) -> str:
        return self._key("consumers", queue)

    def held(self, queue: str) -> str:
        """The workers that beat for the queue without a consumer on it for now (draining, or reconnecting)."""
        return self._key("held", queue)

    def lane_waiters(self, queue: str) -> str:
        return self._key("lane-waiters", queue)

    def lane_handed(self, queue: str) -> str:
        """The books handed a slot of the lane whose refills have not reported back: when, and their places."""
        return self._key("lane-handed", queue)

    def breaker(self, queue: str) -> str:
        return self._key("breaker", queue)

    def breaker_host(self, queue: str, node: str) -> str:
        """The worker node's failed runs of the queue in a row (lua/breaker_record.lua)."""
        return self._key("breaker-host", queue, node)

    def lanes_seen_free(self) -> str:
        """Per queue, when the tick first saw its lane with free slots and books waiting for it."""
        return self._key("lanes-seen-free")

    def lock(self, name: str) -> str:
        return self._key("lock", name)

    def bookmark(self, name: str) -> str:
        return self._key("bookmark", name)

    def metrics(self) -> str:
        return self._key("metrics")

    def counter_batch(self, batch_id: str) -> str:
        """Set when a flushed batch of counter updates is applied: the same batch sent again adds nothing."""
        return self._key_once("metrics-batch", batch_id)

    def departures(self) -> str:
        """When a consumer last stopped consuming each queue cleanly (queue -> when, by the Redis server's clock)."""
        return self._key("departures")

    def unconsumed(self) -> str:
        """When each queue was last found without a consumer by two counts a heartbeat apart (queue -> when, by the
        Redis server's clock): the double count `lanes.gone_for_good` makes, shared by the passes that follow."""
        return self._key("unconsumed")

    def awaited(self) -> str:
        """The queues a pass found waiting for a restarted worker (a set): the first heartbeat on one takes it away
        and hands its lane to the books waiting for it (`lanes.consumers_arrived`)."""
        return self._key("awaited")

    def stage_limits(self) -> str:
        """The stage limits of the control workers' table, which every process's must match (`registry.limits_of`)."""
        return self._key("stage-limits")

    def beats(self) -> str:
        """Each worker node's last heartbeat (name -> when, by the Redis server's clock), whatever it consumes."""
        return self._key("beats")

    def epoch(self) -> str:
        return self._key("epoch")

    def book_pattern(self, kind: str, book: str) -> str:
        """A SCAN MATCH pattern for every key of one kind under one book (never another's)."""
        return f"{self.prefix}{SEP}{kind}{SEP}{encode(book)}{SEP}*"


def pair_member(chapter: str, scene: str, stage: str) -> str:
    """Set/zset member naming one scene x stage inside a book-scoped key. Ids of the characters `encode` keeps
    as they are are joined as they are: three cache lookups a pair were an eighth of a big book's pass."""
    if _unquoted(chapter + scene + stage):
        return SEP.join((chapter, scene, stage))  # not an f-string: a str subclass's __format__ may differ
    return SEP.join((encode(chapter), encode(scene), encode(stage)))


def parse_pair_member(member: str) -> tuple[str, str, str]:
    chapter, scene, stage = member.split(SEP)
    if "%" not in member:  # most members need no unquoting: a pass parses thousands of them
        return chapter, scene, stage
    return decode(chapter), decode(scene), decode(stage)


def held_pass_member(holder: str, book: str) -> str:
    """A hold's member in the held passes: each holder (a batch, a regenerate) has its own, so one letting go of
    its hold never takes another's away."""
    return SEP.join((encode_once(holder), encode(book)))


def parse_held_pass_member(member: str) -> str:
    """The book a held pass's member names (a member of one book only, as an earlier version wrote: that book)."""
    return decode(member.split(SEP, 1)[-1])


def scene_member(chapter: str, scene: str) -> str:
    return SEP.join((encode(chapter), encode(scene)))


def parse_scene_member(member: str) -> tuple[str, str]:
    chapter, scene = member.split(SEP)
    if "%" not in member:
        return chapter, scene
    return decode(chapter), decode(scene)


# -- Postgres advisory-lock names ------------------------------------------------------
# The book first, then the lane(s), sorted: a claim, a completion; every other holder takes its one book's
# lock alone. One order everywhere, and never two books, so two transactions never wait on each other in a cycle.
# *Why the book first:* a commit that waited for its book (behind a whole-book regenerate or an import) held
# its lane meanwhile, and every book's commits and claims on the lane waited for that one book's holder.


def lane_lock(queue: str) -> str:
    """Serializes the capacity count of one queue lane with the claims and completions on it."""
    return f"lane:{queue}"


def book_lock(book: str) -> str:
    """Serializes a book's quota and scene-window count (the window spans the book's stages)."""
    return f"book:{book}"


def claim_locks(queues: Iterable[str], book: str) -> list[str]:
    return [book_lock(book), *(lane_lock(q) for q in sorted(set(queues)))]

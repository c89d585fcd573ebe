//! [`SlotPool`]: a lock-free, fixed-capacity arena of `u32` indices `1..=capacity`.
//!
//! Every other structure in kvpool hands out its resources through one of these:
//! KV token slots, pages, request rows, tree nodes.
//!
//! # Algorithm
//!
//! Two pieces of shared state:
//!
//! * a **bitmap** of `AtomicU64` words; bit `b` of word `w` stands for index
//!   `64*w + b + 1`, and is **1 when the index is free**. Bits past `capacity` in the
//!   last word are always 0.
//! * a **reservation counter** `available`: how many free indices may still be
//!   claimed. It is *sharded*: a central counter plus `SHARDS` (16) per-thread counters,
//!   each on its own cache line; `available` is their sum. A thread uses the shard of
//!   its thread slot (threads get consecutive slots, `sync::thread_slot`).
//!
//! **Alloc(n)** first *reserves*: a compare-and-swap loop takes `n` off the thread's
//! shard if it holds `n`, else off the central counter; if neither does, it *sweeps*
//! every shard into the central counter (a `swap(0)` per non-empty shard, a
//! `fetch_add` of what it moved) and tries the central counter once more. If that
//! fails too, [`OutOfMemory`] — nothing has changed, so allocation is all-or-nothing.
//! It then *claims* `n` bits: starting at a word (see "Where claims start"), for each
//! word with free bits it picks the lowest ones it still needs and clears them with
//! one compare-and-swap — or, while it still needs 64 or more, takes every free bit
//! of the word with one `swap(0)`, which cannot fail; the indices of the cleared bits
//! go to the caller's buffer in ascending order (a stretch of consecutive bits as one
//! vectorised fill).
//!
//! **Free** first *validates*: every index must be in range and its bit must be 0
//! (allocated); otherwise the batch is refused before anything changes. The batch is
//! cut into *runs* (indices that share a word, folded into a mask; a run of
//! consecutive indices is recognised by one branch-free comparison), so validation
//! is one load per run. It then *sets* the bits, one `fetch_or` per run, and finally
//! *publishes*: one `fetch_add` on the thread's shard for the whole batch. A
//! [`FreeGroup`] does the same but delays the publication until the group ends, so
//! its frees become available all at once.
//!
//! Single-threaded, a round of alloc and free costs one read-modify-write on the
//! thread's shard each way and one per bitmap word each way. With several threads
//! that each allocate and free, every thread works on its own shard and (see below)
//! its own words: no cache line is written by two threads in the steady state. When
//! one thread frees what another allocates, the allocating thread sweeps the freeing
//! thread's shard: one line moves, as with a single counter.
//!
//! In front of the bitmap sit per-thread **magazines** (section "Magazines" below):
//! batches of up to `MAGAZINE` (1024) indices are freed onto the calling thread's
//! magazine and allocated from it with a copy, and a third bitmap, `held`, keeps
//! double-free detection exact for the indices sitting in a magazine.
//! [`SlotPool::without_magazines`] builds a pool without them (the allocators use it).
//!
//! **Owned batches** ([`Slots`], [`SlotPool::alloc_slots`], [`SlotPool::free_slots`],
//! module [`owned`]) skip the held bits: a `Slots` can only be filled and emptied by
//! its pool, so the type rules out the double free the bare API must detect, and a
//! per-thread stack of *runs* beside each magazine makes a round of alloc and free one
//! compare-and-swap each way plus writing the indices once.
//!
//! # Why it is correct
//!
//! The invariant that carries everything:
//!
//! > (number of 1 bits) >= `available` + (indices reserved but not yet claimed)
//! > + (counts a sweep has swapped out of a shard and not yet added centrally)
//!
//! * a free sets its bits *before* it adds to a shard: the left side grows first;
//! * a reservation moves `n` from a shard or the central counter to "reserved": the
//!   right side is unchanged;
//! * a sweep moves a count from a shard to "in transit" and then to the central
//!   counter: the right side is unchanged;
//! * a claim clears one bit and retires one reserved index: both sides drop by one.
//!
//! Nothing on the right is tied to particular bits, so which counter a reservation
//! came from does not matter: a thread that holds a reservation always has, at every
//! instant, enough 1 bits in the bitmap that no other reservation is entitled to; its
//! claim loop keeps scanning (wrapping around, from wherever it started) until it has
//! them. No index is handed out twice, because a bit goes 1 -> 0 only through a
//! successful compare-and-swap by exactly one thread, and goes back to 1 only through
//! the free of its owner. At quiescence (no operation in flight, no open free group)
//! the two sides are equal, so `available()` is exact.
//!
//! A count in transit is invisible to reservations for the two instructions between
//! the swap and the add, like a free that has set its bits but not yet published
//! them: an allocation racing with either may be refused although, an instant later,
//! enough would be available. It reports the count it saw. `available()` reads the
//! central counter before the shards, so it never counts a moving count twice.
//!
//! Memory ordering: freeing sets the bit with `Release` and publishes with `Release`;
//! a sweep's swap is `AcqRel` and its add `Release`; reserving and claiming use
//! `Acquire`. Whatever the previous owner of an index wrote before freeing it (for
//! example a request row's contents) happens-before everything the next owner does
//! after claiming it — through the word itself, and through the counters, so the
//! reserver also sees the bits its count stands for.
//!
//! # Why it is lock-free
//!
//! Every loop is a compare-and-swap retry loop whose failure means another thread's
//! compare-and-swap on the same word succeeded — that thread made progress. A
//! reservation tries at most three counters and one sweep of `SHARDS` shards: it
//! ends in a bounded number of steps plus its retries. A claim scan that finds no bit
//! in a full pass can only have missed them because other threads claimed and freed
//! bits meanwhile (each of which completes an operation). A thread stalled anywhere
//! holds nothing the others wait for: a stalled reserver only keeps its `n` indices
//! out of `available`; a stalled freer only keeps its bits uncounted (set but not yet
//! published); a stalled sweeper only keeps the count in its hands out of
//! `available`. All three lower `available` but block nobody.
//!
//! # ABA
//!
//! A word-level compare-and-swap cannot suffer ABA: the value *is* the state. If a word
//! reads `0b1010`, then another thread claims bit 1 and a third frees it again, the
//! word is `0b1010` once more and our compare-and-swap to `0b1000` succeeds — which is
//! right, because bit 1 is free *now*; we do not act on a pointer or a successor read
//! from the old state (the classic Treiber-stack ABA). The table:
//!
//! | step | thread A (alloc 1)          | thread B            | word     |
//! |------|-----------------------------|---------------------|----------|
//! | 1    | load `0b10`                 |                     | `0b10`   |
//! | 2    |                             | alloc: CAS -> `0b00`| `0b00`   |
//! | 3    |                             | free: OR `0b10`     | `0b10`   |
//! | 4    | CAS `0b10 -> 0b00` succeeds |                     | `0b00`   |
//!
//! After step 4 A owns index 2, B owns nothing: one owner. The only ABA left is at the
//! API level: a caller that frees an index *after* it was freed and handed to someone
//! else cannot be told apart from the new owner freeing it. Bare `u32` indices carry
//! no generation; callers that need that detection keep generations beside the index
//! (the radix cache does for its nodes).
//!
//! # Magazines
//!
//! Bonwick & Adams ("Magazines and Vmem", USENIX 2001) put a per-CPU stack of free
//! objects, a *magazine*, in front of a shared allocator, so that most allocations and
//! frees are a push or a pop; a full magazine is exchanged whole with a *depot*. Here:
//!
//! * **Layout.** One `Magazine` per shard (`thread_slot % SHARDS`, the same
//!   assignment as the counter's shards), each on its own cache line: a `busy` flag,
//!   a length `len`, and a stack of `min(MAGAZINE, capacity)` indices allocated at
//!   construction. Plus `held`, a bitmap beside `words`: bit 1 while the index is
//!   handed out. The magazines are part of the capacity: an index in a magazine is
//!   free, counted by `available()`, and in no bitmap.
//! * **Who uses a magazine.** Whoever holds its `busy` flag, taken with a
//!   compare-and-swap `false -> true` (Acquire) and given back with
//!   `store(false, Release)`; only the
//!   holder reads or writes the stack and writes `len`. Threads with the same shard
//!   (more than `SHARDS` threads) share a magazine. Nobody ever waits for the flag: an
//!   operation that finds it taken uses the bitmap instead.
//! * **Free** of `n <= mag_cap` indices, outside a free group: take the magazine;
//!   validate every index (in range, held bit 1) before changing anything; if the
//!   batch does not fit on top, *flush* the magazine first (below); then per run
//!   (indices in one word) clear the held bits with one `fetch_and` and push, in batch
//!   order, the indices whose bit this `fetch_and` cleared (the others were freed by
//!   a racing free since validation: reported with `rest_freed`). A run of
//!   consecutive indices is pushed with one copy. An index named twice in the batch
//!   is found by the validation (see "Repeats" below), so it refuses the batch whole.
//! * **Repeats.** A strict free (`SlotPool::free`, `FreeGroup::free`) refuses a batch
//!   that names an index twice before it changes anything. The validation cuts the
//!   batch into runs (indices in one word) anyway: a repeat inside a run shows in the
//!   run's mask; a run that comes back to a word at or below the highest word before
//!   it is compared with the earlier runs kept on the stack (up to 64). Past that
//!   buffer, such a batch (in no order) marks its runs in `freeing`, a bitmap that is
//!   all 0 at rest, with one `fetch_or` per run, and unmarks them again: O(runs), no
//!   allocation. Ascending batches (what allocation hands out) pay one comparison per
//!   run.
//! * **Alloc** of `n <= mag_cap`: take the magazine; if it holds `n`, copy the top `n`
//!   entries out (in push order, so a batch freed as a run comes back as the same
//!   run), lower `len`, give the magazine back, then set the held bits (one
//!   `fetch_or` per run). Otherwise: the bitmap path (reserve, claim), which now also
//!   sets the held bits of what it claims.
//! * **Flush (the depot exchange).** The bitmap is the depot: a full magazine is
//!   returned whole by storing `len = 0`, setting its entries' bits in `words` (one
//!   `fetch_or` per run, Release) and publishing their count to the shard, the same
//!   order as a free. A reservation that comes up short after sweeping the shards
//!   flushes every magazine it can take (skipping busy ones) and tries once more, so
//!   at quiescence an allocation fails only when `available()` is really short.
//! * **Frees larger than a magazine and free groups** go to the bitmap as before
//!   (clearing held bits first): a group's frees must stay uncounted until it ends,
//!   and a magazine's `len` counts at once. Batches larger than a magazine are
//!   allocated from the bitmap lowest-first. A magazine is only filled by frees, never
//!   refilled from the bitmap, so a fresh pool still hands out `1, 2, 3, ...`.
//!
//! Every index is in exactly one of four places, and `held` tells them apart from the
//! outside: *handed out* (held 1, bit 0), *free in the bitmap* (held 0, bit 1), *in a
//! magazine* (held 0, bit 0, in one stack), or *in transit* (held 0, bit 0, in the
//! hands of an operation between two of its steps: popped but not yet marked held,
//! or cleared by a free but not yet pushed or set in `words`).
//!
//! **Double frees.** Every free, whichever path, first checks the held bits (a
//! load; an index that is not held is refused and nothing changes), then clears them
//! with a `fetch_and` whose old value decides: of two frees racing for one index,
//! exactly one sees the bit set and moves the index on (to a magazine or the bitmap);
//! the other learns it lost and reports the index. An index in a magazine or in
//! transit is not held, so a free of it is refused: double-free detection works for
//! indices sitting in a magazine, exactly as for bitmap ones. The held bits are
//! Relaxed: they order nothing but themselves (every hand-off of an index's contents
//! goes through `words`, whose Release/Acquire pairs are unchanged, or through a
//! magazine's `busy`, whose Release store and Acquire compare-and-swap order the previous
//! holder's pushes, and the writes before them, before the next holder's pops).
//!
//! **No index handed out twice.** An index leaves a magazine only by a pop or a
//! flush, both by the single holder of `busy`; it enters one only after its free won
//! the held bit. It leaves the bitmap only by a claim's compare-and-swap and enters it
//! only after a held bit was won (free) or from a magazine (flush). So each index is
//! moved by one operation at a time, and handed out once per win.
//!
//! **No tags, no ABA.** Nothing here reads a value and later acts on a successor
//! derived from it: `busy`'s compare-and-swap `false -> true` succeeds exactly when
//! nobody holds the magazine *now*, whatever happened in between, and the held bits
//! are changed by `fetch_and`/`fetch_or`, whose old value is the current one. The
//! stack itself is only touched under `busy`. The API-level ABA of the section
//! above remains: a stale free that arrives after its index was popped and handed to
//! someone else is taken for the new owner's free.
//!
//! **Counting.** The reservation counter counts only indices free *in the bitmap*:
//! the invariant of "Why it is correct" holds unchanged, because pops and pushes
//! touch neither bits nor counters and a flush sets bits before it publishes. A
//! magazine's `len` counts its entries. `available()` = central + shards + the
//! magazines' `len`s, read in that order (a flush stores `len = 0` before it
//! publishes, so a count is never seen twice). **Exact when asked at quiescence**: no
//! operation in flight and no open free group (then nothing is in transit, and every
//! `len` and counter is final). Under concurrency it is a snapshot that may be low by
//! what is in transit.
//!
//! **Lock-freedom.** `busy` is only ever *tried*: a thread that finds a magazine
//! taken goes to the bitmap, and a flush skips it. A thread stalled while holding a
//! magazine keeps that magazine's entries out of reach (allocations that need them
//! fail, as they do for a stalled freer's unpublished bits) and blocks nobody. The
//! claim loop's argument is unchanged: reservations are only ever made against bits
//! in `words`.
//!
//! **Cost.** A round of alloc and free of `n` indices through a magazine costs two
//! `busy` compare-and-swaps and one `fetch_and` plus one `fetch_or` per held word (`n / 64` for
//! runs), plus copying `n` indices in and out and a load per run to validate. The
//! bitmap path costs one read-modify-write per word more than without magazines (the
//! held bits), which is why the allocators use [`SlotPool::without_magazines`].
//! BENCHMARKS.md ("Magazines (issue 8)") has the numbers.
//!
//! **Why not region leases** (a thread owning a region of the bitmap and updating
//! it with plain stores). With these guarantees the owner still needs a full fence
//! per free (two frees of one index must agree on one winner: consensus, which
//! plain loads and stores cannot reach; the owner's side of the Dekker handshake
//! with a remote free is a fence) and one per allocation (a thread may take an idle
//! owner's region, so that `available()` stays reachable), unless the stealing side
//! uses a process-wide asymmetric barrier. The bench measures that floor
//! (`lease_floor_2f`, `lease_floor_1f` in `benches/slots.rs`): BENCHMARKS.md,
//! "Region leases (issue 8, second attempt)".
//!
//! **What gets under that floor** is ownership the type system proves. An owned batch
//! ([`Slots`], module [`owned`]) skips the held bits, leaving one `busy`
//! compare-and-swap each way; a private magazine ([`SlotCache`], module [`cache`])
//! is a stock of owned indices that one owner holds by `&mut`, so a round its stock
//! covers touches no atomic at all. Its stock counts as handed out, so `available()`
//! keeps the guarantees above; what it costs is the per-owner stranding of any
//! per-thread cache, bounded by the cache's capacity.
//!
//! # Parked blocks
//!
//! A pool built with [`SlotPool::with_parking`] changes ownership of whole aligned
//! *blocks* of `BLOCK` = 512 indices (8 bitmap words, one cache line of them) with
//! one read-modify-write instead of eight. It is for pools whose users free and take
//! long ranges: a token pool (page size 1), where a request's slots span dozens of
//! blocks; on the bundled trace 90% of the words freed and claimed whole lie in blocks
//! freed whole, and the locked instructions on those words were a quarter of the
//! page-size-1 `cache_ops` loop (BENCHMARKS.md, issue 8, eleventh and twelfth rounds).
//!
//! * **State.** Per block an `AtomicU64`: a *parked* bit (every index of the block is
//!   free, and its words are 0: the block's freedom lives in this bit alone) and a
//!   *generation* in the other 63 bits. A summary bitmap (one bit per block, set when
//!   it may be parked, a hint like `summary`) guides the search, and `parked` counts
//!   the parked blocks not yet reserved.
//! * **Park** (a free of a range that covers a whole block, [`FreeGroup::free_range`]
//!   or the radix cache's run frees): load the state (Acquire); if not parked, check
//!   that the 8 words are 0 (every index handed out); then compare-and-swap the state
//!   from what was loaded to the same with the parked bit (SeqCst). Any failure means
//!   a double free is involved: the free then handles the block word by word, as a
//!   pool without parking would, and reports exactly what that reports. The count goes
//!   to `parked` when the free (or its group) publishes, after the park.
//! * **Word-level frees** set bits with one RMW per word as before and, when they are
//!   done with a block, advance its generation with one `fetch_add` (so one more RMW
//!   per block touched, not per word). If that `fetch_add` finds the block parked, a
//!   block free of the same indices won: the free takes its bits back out of the
//!   words (`fetch_and`) and reports them as freed twice. Validation treats an index
//!   of a parked block as free (a double free, refused with nothing changed).
//! * **Claims.** A reservation takes its count off the words' counters as in any
//!   pool; when they are short (after the sweep), what they hold and enough parked
//!   blocks for the rest, all or nothing (a `Reservation`). The claim then walks the
//!   pool once, in address order from the hint as in any pool, and takes the free
//!   indices it meets at either level: bits from the words, up to the words it
//!   reserved, and parked blocks (`fetch_and` of the parked bit, Acquire: one winner
//!   per block), handed out by whole words. A block it meets when its reservation
//!   holds no block is *traded for*: the claim takes one block off `parked` (or as
//!   many as it still needs) and gives back, at its end, the word count it did not
//!   use; a block whose count other claims hold is passed over. The last block's
//!   remainder is freed back into its words and published. What the walk owes when
//!   its word part is spent comes from the blocks it holds (scan from the block
//!   hint, guided by the summary). So a claim takes the same indices, in the same
//!   order, as in a pool that does not park (on the bundled trace at page size 1 the
//!   same stretches exactly, sequential replay), with one RMW per block instead of
//!   eight. A block handed out whole reaches the claim's receiver as one run of eight
//!   whole words (`Claimed::whole`): one stretch for `claim_stretches`, one fill for
//!   `claim`. A free that parks a block steps past its other words at once
//!   (`BitWords::skip_to`).
//!
//! **Why a double free is still caught once.** The race is a block free of block `B`
//! against a word-level free of an index in `B` (one of them is a double free), and
//! both go through `B`'s state with read-modify-writes, which the state's modification
//! order puts one after the other. If the word free's bits were set before the block
//! free loaded the words, the block free sees them and falls back to words (whose
//! RMWs report the repeat). Otherwise the word free's generation step comes after the
//! block free's state load: before its compare-and-swap, which then fails (fall back
//! to words: the repeat is reported there), or after it, and then the step sees the
//! parked bit and the word free withdraws. Each index bit is removed by exactly one
//! `fetch_and`, so exactly one of the two frees reports success for it. Only an
//! allocation that takes the index between the two frees makes both succeed: the
//! API-level ABA of the section above, as without parking. This argument uses only the
//! atomicity of RMWs on one location and Acquire/Release, so loom checks it as
//! written (`block_free_racing_a_word_free_inside_it` in `tests/loom_slots.rs`
//! reaches all three orders).
//!
//! **Counting and progress.** `available()` adds `parked * BLOCK`. A parked block is
//! counted in `parked` only after it is parked, and a claim takes the count before it
//! unparks one, so the invariant of "Why it is correct" holds with the parked blocks
//! on the left (`check_invariants` checks `ones + BLOCK * parked blocks`). A
//! remainder that a claim frees back is uncounted until published, like any free, so
//! no reservation ever waits for it: a stalled claim only keeps its remainder out of
//! `available`. A claim that trades gives its unused word count back only at its
//! end, so meanwhile `available` reads up to its size lower (a reservation that fails
//! then fails on the count it saw, as any does while another claim is in flight).
//! The block scan wraps around until it wins a block its reservation counted, as
//! the word scan does; `a_claim_trading_for_a_block_racing_one_that_reserved_it` in
//! `tests/loom_slots.rs` checks the trade against a claim that holds the block's
//! count.
//!
//! A free that parks a block lowers the hint to the block, as a free of its words
//! would; frees lower a separate block hint for the blocks a claim owes at its end.
//!
//! **Where it is used.** `PagedAllocator` (so `TokenAllocator`) at page size 1, where
//! a request's slots span dozens of blocks: the radix cache's `cache_ops` loop on the
//! bundled trace ran a third faster, the replays no slower. Not in pools with
//! magazines (held bits would need one RMW per word anyway), nor at larger page
//! sizes, where a request rarely covers a block (8,192 tokens at page size 16) and
//! nothing measurable changed. BENCHMARKS.md, issue 8, twelfth and thirteenth rounds.
//! (The twelfth round's version reserved by a read-only walk ahead of the claim and
//! claimed blocks and words from separate starts: its claims came out in a third
//! more stretches in overlap mode, and it stayed opt-in.)
//!
//! # Where claims start
//!
//! None of this affects correctness, which holds wherever a scan starts.
//!
//! `hint` is a word index below which, in single-threaded use, all words are 0.
//! Frees lower it (read first, then `fetch_min` only if lower), claims raise it past
//! the words they emptied. So a single thread always gets the lowest free indices,
//! ascending, like SGLang's sorted free list.
//!
//! Threads that all start at the hint fight over the same words and cache lines —
//! often without ever losing a compare-and-swap (the line moves between cores, the
//! compare-and-swap still succeeds). So the hint has one *owner* at a time, and the
//! other threads *spread* (all of it heuristics, kept out of loom's model):
//!
//! * `hint_owner` holds the owner's thread slot and a count of its claims; the owner
//!   bumps the count with a plain store on every claim. A thread that is not
//!   spreading and finds the hint unowned takes it. If it finds another owner, it
//!   remembers the owner word and spreads; when it looks again (after spreading) and
//!   the word has not moved — the owner has stopped claiming — it takes over, and
//!   restarts the hint at word 0 (spreading threads do not lower it).
//! * Each shard keeps a *contention gauge*: set to `SPREAD_ROUNDS` (256) when its
//!   threads find the hint owned by an active thread or lose a compare-and-swap (on a
//!   word or a counter), lowered by one per reservation that loses nothing. While it
//!   is up, the shard's threads claim around a *home word* derived from their thread
//!   slot (Fibonacci hashing spreads consecutive slots over the bitmap, aligned to
//!   cache lines of words), do not move the hint and do not lower it when freeing; a
//!   claim that loses on a word moves there at once. Each shard keeps a private
//!   *cursor* for this, the shard's own hint: a spreading claim starts at the cursor
//!   (the home word at first) and leaves it where it stopped, and the shard's frees
//!   lower it to the lowest word they freed between the home word and the cursor. So
//!   in a nearly full pool a spreading thread does not rescan allocated words.
//!
//! *Skipping allocated words.* `summary` has one bit per word of `words`, set when the
//! word may hold free bits: every free sets the bit of each word it sets bits in (a
//! load first, an RMW only if the bit is clear), and a claim's scan clears it lazily
//! when it finds the word empty (then loads the word again and sets the bit back if a
//! free got in between); a claim that empties 8 or more words of one summary word
//! clears their bits itself, one RMW per 64 words (a short alloc + free round would
//! otherwise pay an RMW to clear and another to mark again). The scan steps from candidate to candidate, 64 words per summary
//! load, instead of loading every word: in a nearly full pool whose free indices are
//! scattered (a prefix cache after evictions, at page size 1) claims loaded 26.7 M
//! words to take 118 M indices (1.85 M words' worth) over the bundled trace; guided,
//! 3.7 M. The free's RMW on the word and its load of
//! the summary, and the clearing's RMW on the summary and its load of the word, are
//! `SeqCst`, so a free racing a clearing is seen by one of the two: at quiescence every
//! word with free bits is marked (`check_invariants` checks it), and the order stays
//! lowest-first. Still, the summary is only a hint for the scan: a claim whose guided
//! pass around the bitmap comes up short scans every word, as before.
//!
//! # Placement
//!
//! Lowest-first has one exception, against fragmentation. While a claim still needs
//! 64 indices or more, its first pass over the words passes over *sparse* ones: words
//! whose free stretches strictly inside the word (not reaching its bottom or top bit,
//! which may go on in the neighbouring word) are shorter than 8 on average — the
//! isolated free bits that interleaved small frees leave (a decode step gives each of
//! 32 running requests one slot, so an evicted request frees every 32nd slot). Small
//! claims take those bits, lowest first; a large claim takes them only when its first
//! pass came up short (a second pass takes everything). The hint does not move past a
//! sparse word a claim left behind.
//!
//! Why: a prefix cache at page size 1 with an overlap scheduler otherwise feeds its own
//! fragmentation. With the pool full, each prompt is allocated into the holes that the
//! eviction just made, so it is cut into short runs too, and its eviction later makes
//! more holes: on the bundled trace an evicted leaf averaged 2.6 pages per run, and
//! the radix cache's per-run work (links, bitmaps, token stores) ran 54 M times instead
//! of 35 thousand. With this placement the prompts stay in long runs and only the
//! decode slots are scattered (BENCHMARKS.md, "Issue 8, seventh round"). A fresh pool,
//! or any pool without sparse words, hands out exactly what lowest-first would.
//!
//! So with several threads that each allocate and free, one claims lowest-first from
//! the hint and the others each from their own region: no cache line of words or
//! counters is written by two of them. A single thread owns the hint and never loses a
//! compare-and-swap (all of them are strong, so none fails spuriously): its order is
//! lowest-first; a pool handed from one thread to another is lowest-first again
//! within `SPREAD_ROUNDS` reservations. Under concurrency the hint may be stale; the
//! wrap-around scan keeps it only a hint.
//!
//! # Runs that continue
//!
//! A token allocator's decode step (`PagedAllocator::alloc_decode` at page size 1)
//! hands each running request one slot, and the slot it picks decides how long the
//! request's runs of consecutive slots become. Lowest-first gives a batch of 32
//! requests 32 consecutive slots, so every request's decode slots are 32 apart: a
//! finished request's output is hundreds of one-slot runs, and the radix cache's work
//! (inserting, evicting, freeing) is per run. The claim for a decode step therefore
//! keeps runs going (crate-internal `claim_following`):
//!
//! 1. each request gets the slot after its `last_loc` if that slot is free (what a
//!    larger page size does inside the request's last page);
//! 2. each of the others, in request order, starts a new run: one slot from each word
//!    that has free slots, going down from a *follow cursor* (the top word at first;
//!    afterwards the word below the last one this step took from, wrapping around
//!    once), each at the start of the word's longest free stretch (the lowest one on
//!    a tie), so that the stretch after it stays free for the request's next steps;
//! 3. what that pass cannot place (fewer words with free slots than requests) comes
//!    from a plain claim, lowest-first.
//!
//! Prompts are claimed lowest-first from the hint, so new runs start away from them,
//! and the cursor walks down the pool instead of going back to where the runs of the
//! last steps are still growing. On the bundled trace in overlap mode (32 running
//! requests, page size 1) 90% of the decode slots continue their request's run, and
//! the replay runs about 3x faster (BENCHMARKS.md, "Decode slots that continue their
//! runs"). The counts, the all-or-nothing reservation and the errors are those of any
//! claim: only which free slots are handed out changes.
//!
//! Single-threaded, the result depends only on which slots are free and on the cursor,
//! not on whether a free slot sits in a word or a parked block: the claim first moves
//! the blocks its reservation holds into their words, and a parked block that step 1
//! or 2 wants is moved into its words first (taking its count off `parked`). So the
//! sequential model (`AllocModel::alloc_decode`) follows the rule exactly. Under
//! concurrency, steps 1 and 2 take bits with the claims' compare-and-swap and may come
//! up short (another thread took the slot or the block); step 3 then takes the rest,
//! as any claim would.

use crate::error::{FreeError, FreeErrorKind, InvariantViolation, OutOfMemory, Unit};
use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use crate::sync::{spin_loop, thread_slot, untracked, Backoff, UnsafeCell};
use core::mem::MaybeUninit;
use crossbeam_utils::CachePadded;
pub(crate) use park::Reservation;

const BITS: usize = 64;

/// A lock-free, fixed-capacity arena of `u32` indices `1..=capacity` (0 is reserved).
///
/// All operations take `&self`, never block, and never allocate after construction.
/// See the [module docs](self) for the algorithm and its correctness argument.
///
/// # Examples
///
/// ```
/// use kvpool::SlotPool;
///
/// let pool = SlotPool::new(8);
/// let mut got = [0u32; 3];
/// pool.alloc(&mut got)?;
/// assert_eq!(got, [1, 2, 3]);           // a fresh pool hands out the lowest first
/// assert_eq!(pool.available(), 5);
///
/// pool.free(&got[..2])?;
/// assert!(pool.free(&[1]).is_err());    // double free is detected
/// assert_eq!(pool.available(), 7);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct SlotPool {
    words: Box<[AtomicU64]>,
    /// One bit per word of `words`: set when the word may hold free bits (see "Where
    /// claims start"). A hint: scans never rely on it alone.
    summary: Box<[AtomicU64]>,
    /// The central part of the reservation counter.
    central: CachePadded<AtomicUsize>,
    /// The per-thread parts of the reservation counter, each on its own cache line.
    shards: Box<[CachePadded<Shard>]>,
    hint: CachePadded<AtomicUsize>,
    /// Which thread claims from the hint, a heuristic only (see "Where claims start"):
    /// its thread slot in the high 32 bits and a count of its claims in the low 32, or
    /// [`NO_OWNER`].
    hint_owner: CachePadded<untracked::AtomicU64>,
    /// Where the next claim that follows runs looks for a word to start a run in, going
    /// down ([`claim_following`](Self::claim_following), "Runs that continue");
    /// `usize::MAX`: the top word. A hint only.
    follow_cursor: untracked::AtomicUsize,
    /// Bits set by open free groups but not yet added to `available`.
    unpublished: AtomicUsize,
    /// One bit per index, **1 while the index is handed out** (see "Magazines"):
    /// the authority for double-free detection once magazines hold free indices
    /// whose bitmap bit is 0 too. Empty in a pool without magazines, where
    /// "handed out" is simply "bit 0 in `words`".
    held: Box<[AtomicU64]>,
    /// One bit per index, set only while a strict free checks a batch for an index
    /// named twice, in the one case its validation cannot settle from the runs alone:
    /// more runs than the stack buffer, out of word order (see
    /// [`repeat_by_marks`](Self::repeat_by_marks)). All 0 at rest. Empty in the KV
    /// allocators' page pools, whose frees merge repeats.
    freeing: Box<[AtomicU64]>,
    /// One magazine per shard (`thread_slot % SHARDS`); empty without magazines.
    mags: Box<[CachePadded<Magazine>]>,
    /// Entries each magazine holds at most: `min(MAGAZINE, capacity)`, 0 without
    /// magazines.
    mag_cap: usize,
    /// The parked blocks' state (see "Parked blocks"), boxed: a pool stays small
    /// enough to build on a loom thread's stack. No blocks unless the pool parks.
    park: Box<park::Park>,
    /// Whether the pool parks blocks (`park` has blocks): read on every free and
    /// reservation, so kept here rather than behind the box.
    parks: bool,
    /// Indices an owned batch's runs magazine holds at most (module docs, "Owned
    /// batches"); 0 without magazines.
    run_cap: usize,
    /// Indices handed to a [`Slots`] by the bitmap minus those returned to it
    /// (wrapping; the magazines count theirs). For `check_invariants` only.
    owned_bitmap: AtomicUsize,
    /// This pool's identity for [`Slots`], new at construction and at every
    /// [`clear`](Self::clear), so that a batch is only ever returned to the pool (and
    /// the epoch) that filled it.
    id: u64,
    capacity: u32,
}

/// A per-thread magazine (Bonwick & Adams 2001): a stack of free indices, taken
/// off the bitmap, that its threads allocate from and free into with a copy.
///
/// Used only by the thread that holds `busy`; other threads (a flush when an
/// allocation runs short) take it the same way and skip it when it is busy.
struct Magazine {
    /// Whether a thread is using the magazine. Taken with a compare-and-swap
    /// `false -> true` (Acquire), given back with `store(false, Release)`: every access to
    /// `slots` and every write of `len` happens between the two, so the holders'
    /// accesses are ordered one after the other. Nobody ever waits for it.
    busy: AtomicBool,
    /// Entries in `slots[..len]`. Written only by the holder of `busy`; read without
    /// it by `available()` (a snapshot, like the counters).
    len: AtomicUsize,
    /// The stack, bottom first; `mag_cap` entries allocated at construction.
    slots: UnsafeCell<Box<[u32]>>,
    /// The runs magazine of owned batches ([`Slots`], module docs "Owned batches"):
    /// runs `(first, count)` of indices, bottom first; `run_entries(mag_cap)` allocated
    /// at construction. Same `busy` flag.
    runs: UnsafeCell<Box<[(u32, u32)]>>,
    /// Entries in `runs[..nruns]`. Written and read only by the holder of `busy`.
    nruns: AtomicUsize,
    /// Indices in those runs. Written only by the holder; read without it by
    /// `available()` (a snapshot, like `len`).
    run_total: AtomicUsize,
    /// Indices handed to a [`Slots`] through this magazine minus those taken back
    /// through it (wrapping: a batch may come back through another magazine). Written
    /// only by the holder; summed by `check_invariants`.
    owned: AtomicUsize,
}

// SAFETY: every field but the magazines' `slots` cells is an atomic or plain data.
// A `slots` cell is read and written only through a `MagazineGuard`, which exists only
// while its thread holds that magazine's `busy` flag (an Acquire compare-and-swap
// from `false` to `true`, ended by a Release store), so no two accesses overlap and each happens
// after the previous holder's.
unsafe impl Sync for SlotPool {}

/// Entries of a magazine. Batches up to this size go through the calling thread's
/// magazine; larger ones go to the bitmap (lowest-first). 1024 indices = 4 KiB per
/// shard, 64 KiB per pool at most (less when the capacity is smaller).
#[cfg(not(loom))]
pub(crate) const MAGAZINE: usize = 1024;
/// Two entries let loom see a magazine fill up and be flushed with batches of one
/// and two; more would only multiply the interleavings.
#[cfg(loom)]
pub(crate) const MAGAZINE: usize = 2;

/// The right to use one magazine: held `busy`, given back on drop.
struct MagazineGuard<'a> {
    mag: &'a Magazine,
}

impl Magazine {
    fn new(cap: usize) -> Self {
        Magazine {
            busy: AtomicBool::new(false),
            len: AtomicUsize::new(0),
            slots: UnsafeCell::new(vec![0u32; cap].into_boxed_slice()),
            runs: UnsafeCell::new(vec![(0u32, 0u32); owned::run_entries(cap)].into_boxed_slice()),
            nruns: AtomicUsize::new(0),
            run_total: AtomicUsize::new(0),
            owned: AtomicUsize::new(0),
        }
    }

    /// Take the magazine if no other thread is using it; never waits.
    #[inline]
    fn try_take(&self) -> Option<MagazineGuard<'_>> {
        // Acquire: the previous holder's writes to `slots` and `len` (before its
        // Release store of `false`) happen-before ours. A compare-and-swap rather than
        // a swap: a failed attempt writes nothing. (loom 0.7 also let a later swap
        // read the `true` of a failed swap that came before the holder's release.)
        match self.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => Some(MagazineGuard { mag: self }),
            // Another thread is using it: the caller goes to the bitmap instead.
            Err(_) => None,
        }
    }
}

impl MagazineGuard<'_> {
    #[inline]
    fn len(&self) -> usize {
        // Only holders write `len`, and we are the holder.
        self.mag.len.load(Ordering::Relaxed)
    }

    #[inline]
    fn set_len(&self, len: usize) {
        // Release for `available()`'s Acquire load (a flush stores 0 before it
        // publishes the count, so that a reader never counts the entries twice).
        self.mag.len.store(len, Ordering::Release);
    }

    /// Run `f` on the whole stack.
    #[inline]
    fn with_slots<R>(&self, f: impl FnOnce(&mut [u32]) -> R) -> R {
        self.mag.slots.with_mut(|p| {
            // SAFETY: this guard exists only while our thread holds `busy` (see
            // `try_take`), and only holders touch the cell: nothing else reads or
            // writes it now. `p` points at the cell's live, initialised box.
            let slots = unsafe { &mut *p };
            f(slots)
        })
    }

    /// Run `f` on the whole runs stack (owned batches).
    #[inline]
    fn with_runs<R>(&self, f: impl FnOnce(&mut [(u32, u32)]) -> R) -> R {
        self.mag.runs.with_mut(|p| {
            // SAFETY: as in `with_slots`: only the holder of `busy` touches the cell,
            // and this guard exists only while our thread holds it.
            let runs = unsafe { &mut *p };
            f(runs)
        })
    }
}

impl Drop for MagazineGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        // Release: our accesses to `slots` and `len` happen-before the next holder's.
        self.mag.busy.store(false, Ordering::Release);
    }
}

/// One shard of the reservation counter, used by the threads whose
/// [`thread_slot`](crate::sync::thread_slot) maps to it.
struct Shard {
    /// Free indices published here (by frees of this shard's threads) and not yet
    /// reserved or swept into the central counter.
    available: AtomicUsize,
    /// Contention gauge of this shard's threads, a heuristic only (see "Where claims
    /// start" in the module docs): set to [`SPREAD_ROUNDS`] when one of their
    /// compare-and-swaps loses to another thread or they find the hint owned by an
    /// active thread, lowered by one per reservation that lost nothing. While it is
    /// non-zero their claims start at their home word instead of the shared hint.
    spread: untracked::AtomicU32,
    /// The `hint_owner` value this shard's threads saw when they last found the hint
    /// taken: if it has not moved on since, its owner has stopped claiming.
    seen_owner: untracked::AtomicU64,
    /// Where this shard's spreading claims start: the word the last one stopped at,
    /// lowered by their own frees in their region; [`NO_CURSOR`] until the first. The
    /// shard's private hint, so that a spreading thread in a nearly full pool does not
    /// rescan the allocated words after its home on every claim.
    cursor: untracked::AtomicUsize,
}

/// `Shard::cursor` before the shard's first spreading claim.
const NO_CURSOR: usize = usize::MAX;

/// `hint_owner` when no thread owns the hint.
const NO_OWNER: u64 = u64::MAX;

/// Shards of the reservation counter. Threads get consecutive slots, so up to this
/// many threads each have a shard of their own.
#[cfg(not(loom))]
const SHARDS: usize = 16;
/// Two shards are enough for loom to see counts move between shards and the central
/// counter; more only multiply the interleavings.
#[cfg(loom)]
const SHARDS: usize = 2;

/// How many uncontended reservations a shard's threads spread for after a sign of
/// contention, before they look at the hint again.
const SPREAD_ROUNDS: u32 = 256;

/// Bitmap words per 64-byte cache line; home words are aligned to it.
const WORDS_PER_LINE: usize = 8;

/// Runs (word, mask) of a free batch kept on the stack between validating and
/// applying; a batch with more runs rebuilds the rest (1 KiB of stack).
#[cfg(not(loom))]
const RUN_BUF: usize = 64;
/// Two runs let loom reach what lies past the buffer (the rebuilt runs, a repeat
/// check by marks) with batches of three or four runs.
#[cfg(loom)]
const RUN_BUF: usize = 2;

/// How `release` treats an index whose bit it finds already set while applying.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dup {
    /// A double free: report it.
    Strict,
    /// Expected: the same index appears more than once in the batch (pages of token
    /// slots). Validation already showed every index was allocated at the start.
    Merge,
}

impl SlotPool {
    /// A pool of indices `1..=capacity`, all free, with per-thread magazines (see
    /// the module docs: batches of up to [`magazine_capacity`](Self::magazine_capacity)
    /// indices are freed into and allocated from the calling thread's magazine, last
    /// freed first).
    ///
    /// Allocates the bitmaps (`capacity / 64` words each) and the magazines
    /// (`16 * min(1024, capacity)` indices, and 16 runs stacks of 64 runs for owned
    /// batches, [`Slots`]) once; nothing after this allocates.
    pub fn new(capacity: u32) -> Self {
        Self::build(capacity, MAGAZINE.min(capacity as usize), false)
    }

    /// A pool of indices `1..=capacity` without magazines: every allocation takes the
    /// lowest free indices, ascending (SGLang's sorted free list; but see "Placement"
    /// in the module docs for large claims), at the cost of a compare-and-swap per
    /// bitmap word each way.
    ///
    /// # Examples
    ///
    /// ```
    /// let pool = kvpool::SlotPool::without_magazines(300);
    /// let mut all = [0u32; 300];
    /// pool.alloc(&mut all)?;
    /// pool.free(&[250, 5, 130])?;
    /// let mut got = [0u32; 3];
    /// pool.alloc(&mut got)?;
    /// assert_eq!(got, [5, 130, 250]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn without_magazines(capacity: u32) -> Self {
        Self::build(capacity, 0, false)
    }

    /// A pool of indices `1..=capacity` without magazines that **parks** whole blocks
    /// (module docs, "Parked blocks"): a free of a range that covers an aligned block
    /// of 512 indices parks it with one read-modify-write instead of eight, and an
    /// allocation takes a parked block whole with one read-modify-write, in the same
    /// lowest-first order as [`without_magazines`](Self::without_magazines). For pools
    /// whose callers free and allocate long ranges (kvpool's token allocators use it);
    /// otherwise as [`without_magazines`](Self::without_magazines).
    ///
    /// # Examples
    ///
    /// ```
    /// let pool = kvpool::SlotPool::with_parking(2048);
    /// let mut all = vec![0u32; 2048];
    /// pool.alloc(&mut all)?;
    /// let mut group = pool.free_group();
    /// group.free_range(513, 1024)?;          // two whole blocks: parked
    /// group.free_range(5, 3)?;               // three indices: in their word
    /// assert_eq!(group.end(), 1027);
    /// assert!(!pool.is_allocated(600) && pool.is_allocated(4));
    /// let mut got = vec![0u32; 515];
    /// pool.alloc(&mut got)?;                 // block 513..=1024 whole, 3 of the next;
    /// assert!(got.iter().copied().eq(513..=1027)); // (a large claim passes over 5..=7)
    /// assert_eq!(pool.available(), 512);     // the rest of that block is in its words
    /// let mut few = [0u32; 3];
    /// pool.alloc(&mut few)?;
    /// assert_eq!(few, [5, 6, 7]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_parking(capacity: u32) -> Self {
        Self::build(capacity, 0, true)
    }

    /// A pool of indices `1..=capacity` whose magazines hold `entries` indices each
    /// (at most `capacity`; 0 is [`without_magazines`](Self::without_magazines)).
    /// Small magazines let tests reach the flush paths with small batches.
    ///
    /// # Examples
    ///
    /// ```
    /// let pool = kvpool::SlotPool::with_magazines(100, 4);
    /// assert_eq!(pool.magazine_capacity(), 4);
    /// let mut a = [0u32; 10];
    /// pool.alloc(&mut a)?;
    /// pool.free(&a[..3])?;                   // onto the magazine
    /// pool.free(&a[3..5])?;                  // does not fit: the magazine is flushed first
    /// let mut b = [0u32; 2];
    /// pool.alloc(&mut b)?;
    /// assert_eq!(b, [4, 5]);                 // the last batch freed, in push order
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_magazines(capacity: u32, entries: usize) -> Self {
        Self::build(capacity, entries.min(capacity as usize), false)
    }

    /// The KV allocators' page pool: as [`with_parking`](Self::with_parking) or
    /// [`without_magazines`](Self::without_magazines), without the bitmap a strict
    /// free's repeat check may need (their frees merge repeats).
    pub(crate) fn for_pages(capacity: u32, parking: bool) -> Self {
        Self::build_with(capacity, 0, parking, false)
    }

    fn build(capacity: u32, mag_cap: usize, parking: bool) -> Self {
        Self::build_with(capacity, mag_cap, parking, true)
    }

    fn build_with(capacity: u32, mag_cap: usize, parking: bool, strict: bool) -> Self {
        crate::iota::prepare();
        let nwords = (capacity as usize).div_ceil(BITS);
        let words: Box<[AtomicU64]> = (0..nwords).map(|_| AtomicU64::new(0)).collect();
        let held_words = if mag_cap > 0 { nwords } else { 0 };
        let (nmags, mag_cap) = if mag_cap > 0 { (SHARDS, mag_cap) } else { (0, 0) };
        // Blocks wholly inside the capacity, in pools that park (never with magazines).
        let nblocks = if parking && mag_cap == 0 { capacity as usize / park::BLOCK } else { 0 };
        let summary = (0..nwords.div_ceil(BITS)).map(|_| AtomicU64::new(0)).collect();
        let pool = SlotPool {
            words,
            summary,
            central: CachePadded::new(AtomicUsize::new(0)),
            shards: (0..SHARDS)
                .map(|_| {
                    CachePadded::new(Shard {
                        available: AtomicUsize::new(0),
                        spread: untracked::AtomicU32::new(0),
                        seen_owner: untracked::AtomicU64::new(NO_OWNER),
                        cursor: untracked::AtomicUsize::new(NO_CURSOR),
                    })
                })
                .collect(),
            hint: CachePadded::new(AtomicUsize::new(0)),
            hint_owner: CachePadded::new(untracked::AtomicU64::new(NO_OWNER)),
            follow_cursor: untracked::AtomicUsize::new(usize::MAX),
            unpublished: AtomicUsize::new(0),
            held: (0..held_words).map(|_| AtomicU64::new(0)).collect(),
            freeing: (0..if strict { nwords } else { 0 }).map(|_| AtomicU64::new(0)).collect(),
            mags: (0..nmags).map(|_| CachePadded::new(Magazine::new(mag_cap))).collect(),
            mag_cap,
            park: Box::new(park::Park::new(nblocks)),
            parks: nblocks > 0,
            run_cap: (mag_cap * owned::RUN_SCALE).min(capacity as usize),
            owned_bitmap: AtomicUsize::new(0),
            id: owned::next_pool_id(),
            capacity,
        };
        pool.fill();
        pool
    }

    /// Set every bit of `1..=capacity` and make them all available (centrally).
    fn fill(&self) {
        let cap = self.capacity as usize;
        for (w, word) in self.words.iter().enumerate() {
            let lo = w * BITS;
            let n = (cap - lo).min(BITS);
            let bits = if n == BITS { u64::MAX } else { (1u64 << n) - 1 };
            word.store(bits, Ordering::Relaxed);
        }
        for (k, sw) in self.summary.iter().enumerate() {
            let n = (self.words.len() - k * BITS).min(BITS);
            sw.store(if n == BITS { u64::MAX } else { (1u64 << n) - 1 }, Ordering::Relaxed);
        }
        for shard in self.shards.iter() {
            shard.available.store(0, Ordering::Relaxed);
            shard.spread.store(0, untracked::Ordering::Relaxed);
            shard.seen_owner.store(NO_OWNER, untracked::Ordering::Relaxed);
            shard.cursor.store(NO_CURSOR, untracked::Ordering::Relaxed);
        }
        self.hint_owner.store(NO_OWNER, untracked::Ordering::Relaxed);
        self.follow_cursor.store(usize::MAX, untracked::Ordering::Relaxed);
        self.central.store(cap, Ordering::Release);
        self.hint.store(0, Ordering::Relaxed);
        self.unpublished.store(0, Ordering::Relaxed);
        for word in self.held.iter() {
            word.store(0, Ordering::Relaxed);
        }
        for mag in self.mags.iter() {
            mag.len.store(0, Ordering::Relaxed);
            mag.nruns.store(0, Ordering::Relaxed);
            mag.run_total.store(0, Ordering::Relaxed);
            mag.owned.store(0, Ordering::Relaxed);
            mag.busy.store(false, Ordering::Release);
        }
        self.owned_bitmap.store(0, Ordering::Relaxed);
        self.reset_blocks();
    }

    /// The calling thread's magazine, if the pool has magazines.
    #[inline]
    fn my_magazine(&self) -> Option<&Magazine> {
        self.mags.get(thread_slot() % SHARDS).map(|m| &**m)
    }

    /// How many indices a magazine holds at most: batches of up to this many go
    /// through the calling thread's magazine. 0 for a pool without magazines.
    #[inline]
    pub fn magazine_capacity(&self) -> usize {
        self.mag_cap
    }

    /// Bits of `mask` in word `w` whose indices are **not** handed out: held bits 0
    /// with magazines, else bitmap bits 1. One load; a snapshot under concurrency.
    #[inline]
    fn not_held(&self, w: usize, mask: u64) -> u64 {
        match self.held.get(w) {
            Some(h) => mask & !h.load(Ordering::Relaxed),
            None if self.parked_at(w) => mask,
            None => mask & self.words[w].load(Ordering::Relaxed),
        }
    }

    /// Note in the summary that the words of `b` may hold free bits (after setting
    /// some). Reads first: the summary line stays shared while the bits are set.
    #[inline]
    fn mark(&self, b: SummaryBits) {
        if b.bits == 0 {
            return;
        }
        let sw = &self.summary[b.sw];
        // SeqCst, after the caller's SeqCst RMWs on the words: the other half of the
        // clearing's fetch_and + load (see `unmark`). The summary orders nothing else:
        // claims take bits through `words` with Acquire.
        let missing = b.bits & !sw.load(Ordering::SeqCst);
        if missing != 0 {
            sw.fetch_or(missing, Ordering::Relaxed);
        }
    }

    /// Clear the summary bits of `b`'s words, which were found empty, with one RMW;
    /// then look at each word again and set its bit back if a free got in between.
    fn unmark(&self, b: SummaryBits) {
        let summary = &self.summary[b.sw];
        // SeqCst here and in the loads below, as in a free's RMW on the word and its
        // load of the summary (`mark`): of a free that sets bits in one of these words
        // and this clearing, one sees the other (the store-buffering pattern that
        // SeqCst forbids), so either the free sets the bit again or the load below sees
        // its bits. So at quiescence every word with free bits is marked
        // (`check_invariants` checks it).
        summary.fetch_and(!b.bits, Ordering::SeqCst);
        let mut m = b.bits;
        while m != 0 {
            let k = m.trailing_zeros() as usize;
            m &= m - 1;
            if self.words[b.sw * BITS + k].load(Ordering::SeqCst) != 0 {
                summary.fetch_or(1 << k, Ordering::Relaxed);
            }
        }
    }

    /// The scan found word `w` empty: [`unmark`](Self::unmark) it if it is marked.
    /// Returns what the word holds now (not 0: a free got in, and it is marked again).
    #[inline]
    fn unmark_empty(&self, w: usize) -> u64 {
        let b = SummaryBits::of(w);
        if self.summary[b.sw].load(Ordering::Relaxed) & b.bits == 0 {
            return 0;
        }
        self.unmark(b);
        self.words[w].load(Ordering::Relaxed)
    }

    /// A claim emptied the words of `b`: [`unmark`](Self::unmark) them if there are at
    /// least [`UNMARK_MIN`]; fewer are left marked (a later scan that finds them empty
    /// clears them): a short alloc + free round would otherwise pay an RMW to clear
    /// and, in the free, another to mark again.
    #[inline]
    fn unmark_emptied(&self, b: SummaryBits) {
        if (b.bits.count_ones() as usize) >= UNMARK_MIN {
            self.unmark(b);
        }
    }

    /// The first word from `from` on (before `words.len()`) whose summary bit is set, or
    /// `words.len()` if there is none.
    #[inline]
    fn next_marked(&self, from: usize) -> usize {
        let n = self.words.len();
        let mut k = from / BITS;
        if from >= n {
            return n;
        }
        let mut bits = self.summary[k].load(Ordering::Relaxed) & (u64::MAX << (from % BITS));
        loop {
            if bits != 0 {
                return (k * BITS + bits.trailing_zeros() as usize).min(n);
            }
            k += 1;
            if k == self.summary.len() {
                return n;
            }
            bits = self.summary[k].load(Ordering::Relaxed);
        }
    }

    /// Mark the bits of `mask` in word `w` handed out (magazines only).
    #[inline]
    fn set_held(&self, w: usize, mask: u64) {
        if let Some(h) = self.held.get(w) {
            // Relaxed: the held bits order nothing but themselves (double-free
            // detection); the hand-off of the index's contents goes through `words`
            // or a magazine's `busy`.
            h.fetch_or(mask, Ordering::Relaxed);
        }
    }

    /// The shard of the calling thread.
    #[inline]
    fn my_shard(&self) -> &Shard {
        &self.shards[thread_slot() % SHARDS]
    }

    /// The number of indices, `capacity`; valid indices are `1..=capacity`.
    #[inline]
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// How many indices can be allocated now. Exact when no operation is in flight and
    /// no free group is open; under concurrency a snapshot. Sums the counter's shards:
    /// a few loads, no writes.
    pub fn available(&self) -> usize {
        // Central first: a count that a sweep moves from a shard to the central counter
        // is then seen at most once (if this load sees the add, the shard loads after it
        // see the swap that preceded it).
        let central = self.central.load(Ordering::Acquire);
        let shards = self.shards.iter().map(|s| s.available.load(Ordering::Acquire)).sum::<usize>();
        // Magazines last: a flush stores 0 in `len` before it publishes the count to a
        // shard, so if the shard loads above saw the count, these see the 0.
        // Parked blocks: a claim takes the count before it unparks a block, and a
        // free parks a block before it publishes it, so a block is never counted twice.
        let parked = self.park.parked.load(Ordering::Acquire) * park::BLOCK;
        let mags = self
            .mags
            .iter()
            .map(|m| m.len.load(Ordering::Acquire) + m.run_total.load(Ordering::Acquire))
            .sum::<usize>();
        central + shards + mags + parked
    }

    /// Whether `index` is currently handed out by [`alloc`](Self::alloc) (`false` for
    /// out-of-range indices, for indices sitting in a magazine, for indices freed inside
    /// a still-open free group, and for indices owned by a [`Slots`], whose ownership
    /// the `Slots` itself carries). A snapshot under concurrency.
    #[inline]
    pub fn is_allocated(&self, index: u32) -> bool {
        if index == 0 || index > self.capacity {
            return false;
        }
        let (w, bit) = Self::locate(index);
        match self.held.get(w) {
            Some(h) => h.load(Ordering::Acquire) & bit != 0,
            None => self.words[w].load(Ordering::Acquire) & bit == 0 && !self.parked_at(w),
        }
    }

    #[inline]
    fn locate(index: u32) -> (usize, u64) {
        let i = index as usize - 1;
        (i / BITS, 1u64 << (i % BITS))
    }

    /// Allocate `out.len()` indices into `out`, all or nothing.
    ///
    /// Up to [`magazine_capacity`](Self::magazine_capacity) indices come from the
    /// calling thread's magazine when it holds that many: the most recently freed
    /// ones, in the order they were freed (a run freed together comes back as that
    /// run). Otherwise, and always for larger batches and in a pool
    /// [`without_magazines`](Self::without_magazines), single-threaded the indices are
    /// the lowest free ones, ascending (a fresh pool hands out `1, 2, 3, ...`), except
    /// that a batch of 64 or more passes over scattered free indices while it can
    /// (module docs, "Placement").
    ///
    /// # Errors
    ///
    /// [`OutOfMemory`] when fewer than `out.len()` are available; `out` is untouched
    /// and nothing changed.
    ///
    /// # Examples
    ///
    /// ```
    /// let pool = kvpool::SlotPool::new(4);
    /// let mut a = [0u32; 4];
    /// pool.alloc(&mut a)?;
    /// let err = pool.alloc(&mut [0u32; 1]).unwrap_err();
    /// assert_eq!((err.requested, err.available), (1, 0));
    /// # Ok::<(), kvpool::OutOfMemory>(())
    /// ```
    pub fn alloc(&self, out: &mut [u32]) -> Result<(), OutOfMemory> {
        self.alloc_as(out, Unit::Indices)
    }

    pub(crate) fn alloc_as(&self, out: &mut [u32], unit: Unit) -> Result<(), OutOfMemory> {
        if out.is_empty() {
            return Ok(());
        }
        if out.len() <= self.mag_cap && self.alloc_from_magazine(out) {
            crate::debug_check(self);
            return Ok(());
        }
        let r = self.reserve(out.len(), unit)?;
        self.claim(r, out);
        crate::debug_check(self);
        Ok(())
    }

    /// Pop the top `out.len()` entries of the calling thread's magazine into `out`,
    /// in the order they were pushed, if it holds that many and no other thread is
    /// using it; `false` (nothing changed) otherwise.
    #[inline]
    fn alloc_from_magazine(&self, out: &mut [u32]) -> bool {
        let Some(mag) = self.my_magazine() else { return false };
        let Some(guard) = mag.try_take() else { return false };
        let len = guard.len();
        let n = out.len();
        if len < n {
            return false;
        }
        guard.with_slots(|slots| out.copy_from_slice(&slots[len - n..len]));
        guard.set_len(len - n);
        drop(guard);
        // The entries are ours now (in transit: neither held nor in a magazine, so a
        // stray free of one is refused); mark them handed out before returning them.
        for_each_run(out, |w, mask| self.set_held(w, mask));
        true
    }

    /// Allocate one index.
    ///
    /// # Errors
    ///
    /// [`OutOfMemory`] when none is available.
    pub fn alloc_one(&self) -> Result<u32, OutOfMemory> {
        let mut one = [0u32; 1];
        self.alloc(&mut one)?;
        Ok(one[0])
    }

    /// Take `n` off the reservation counter, or fail without changing anything.
    ///
    /// From the calling thread's shard if it holds `n` (the common case: what this
    /// thread freed, on a cache line no other thread writes), else from the central
    /// counter, else after sweeping every shard into the central counter. In a pool
    /// that parks, parked blocks for the rest when the words are short
    /// ([`reserve_mixed`](Self::reserve_mixed)); the claim also trades what it
    /// reserved for the parked blocks it meets ("Parked blocks").
    pub(crate) fn reserve(&self, n: usize, unit: Unit) -> Result<Reservation, OutOfMemory> {
        match self.take_words(n) {
            Ok(()) => Ok(Reservation::words(n)),
            // What the central counter held after the sweep: the count the decision was
            // made on (at quiescence, everything).
            Err(seen) if !self.parks || self.park.parked.load(Ordering::Relaxed) == 0 => {
                Err(OutOfMemory { requested: n, available: seen, evictable: None, unit })
            }
            // With the parked blocks: the total the decision was made on.
            Err(_) => self.reserve_mixed(n).map_err(|seen| OutOfMemory {
                requested: n,
                available: seen,
                evictable: None,
                unit,
            }),
        }
    }

    /// Take `n` off the words' reservation counter: the calling thread's shard, the
    /// central counter, or the central counter after a sweep (and, with magazines,
    /// after flushing them). Fails with what the central counter held after the sweep.
    pub(crate) fn take_words(&self, n: usize) -> Result<(), usize> {
        if n == 0 {
            return Ok(());
        }
        let shard = self.my_shard();
        let taken = take(&shard.available, n)
            .or_else(|_| take(&self.central, n))
            .or_else(|_| {
                self.sweep();
                take(&self.central, n)
            })
            .or_else(|seen| {
                // Still short: return what the magazines hold to the bitmap and count
                // it, then try once more.
                if self.flush_magazines() {
                    self.sweep();
                    take(&self.central, n)
                } else {
                    Err(seen)
                }
            });
        taken.map(|lost| gauge_contention(shard, lost))
    }

    /// Return every magazine's entries to the bitmap (and their count to the
    /// counters), skipping magazines that another thread is using. Whether anything
    /// moved. At quiescence this empties every magazine, so an allocation that fails
    /// after it fails on the exact count.
    #[cold]
    fn flush_magazines(&self) -> bool {
        let mut moved = false;
        for mag in self.mags.iter() {
            // Read first: an empty magazine's line stays shared.
            if mag.len.load(Ordering::Acquire) == 0 && mag.run_total.load(Ordering::Acquire) == 0 {
                continue;
            }
            if let Some(guard) = mag.try_take() {
                moved |= self.flush(&guard) + self.flush_runs(&guard) > 0;
            }
        }
        moved
    }

    /// Return a magazine's entries to the bitmap: set their bits, then publish their
    /// count (the order a free uses). Returns how many.
    fn flush(&self, guard: &MagazineGuard<'_>) -> usize {
        let len = guard.len();
        if len == 0 {
            return 0;
        }
        // 0 first: `available()` may count the entries late, never twice.
        guard.set_len(0);
        let mut min_word = usize::MAX;
        guard.with_slots(|slots| for_each_run(&slots[..len], |w, mask| self.return_bits(w, mask, &mut min_word)));
        self.lower_hint(min_word);
        self.publish(len);
        len
    }

    /// Set bits `mask` of word `w`, indices that are neither held nor free (a
    /// magazine's or an owned batch's), and mark the word; `min_word` tracks the lowest
    /// word for the hint. The caller publishes the count afterwards.
    #[inline]
    fn return_bits(&self, w: usize, mask: u64, min_word: &mut usize) {
        // Release: whatever the indices' previous owners wrote (ordered before our
        // holding them) happens-before the next claim of them. SeqCst: Release for the
        // reason above, and the first half of the summary's ordering (see `unmark`).
        let old = self.words[w].fetch_or(mask, Ordering::SeqCst);
        debug_assert_eq!(old & mask, 0, "an index returned to the bitmap was free in it");
        self.mark(SummaryBits::of(w));
        *min_word = (*min_word).min(w);
    }

    /// Move every shard's count into the central counter. A count is in transit between
    /// the swap and the add, invisible to reservations like a free that has set its
    /// bits but not yet published them.
    #[cold]
    fn sweep(&self) {
        for shard in self.shards.iter() {
            // Read first: an empty shard's line stays shared.
            if shard.available.load(Ordering::Relaxed) != 0 {
                // AcqRel: Acquire takes over the publications that went into the shard
                // (their bits are visible to us), Release passes them on through the
                // central counter to whoever reserves them there.
                let moved = shard.available.swap(0, Ordering::AcqRel);
                if moved != 0 {
                    self.central.fetch_add(moved, Ordering::Release);
                }
            }
        }
    }

    /// Claim `out.len()` bits that a reservation entitles us to; writes them ascending
    /// within each word, words in scan order (ascending when single-threaded).
    ///
    /// The scan starts at `hint` (lowest-first order), or at this thread's home word
    /// while the contention gauge is up; a compare-and-swap lost on a word moves the
    /// rest of the scan to the home word too. Where the scan starts never matters for
    /// correctness: it visits every word, wrapping around, until it has them all.
    pub(crate) fn claim(&self, r: Reservation, out: &mut [u32]) {
        debug_assert_eq!(r.len(), out.len());
        self.claim_marked::<true>(r, Indices { out, filled: 0 });
    }

    /// [`claim`](Self::claim) `n` indices, handing them to `each(first, count)` as
    /// stretches of consecutive indices (`first..first + count`) instead of writing
    /// them: one call per stretch of a word's claimed bits, in claim order (what
    /// `claim` would write, in order). Two calls in a row may continue each other
    /// (across a word boundary).
    #[inline]
    pub(crate) fn claim_stretches(&self, r: Reservation, each: impl FnMut(u32, usize)) {
        self.claim_stretches_marked::<true>(r, each)
    }

    /// [`claim_stretches`](Self::claim_stretches); `HELD` as in
    /// [`claim_marked`](Self::claim_marked).
    #[inline]
    pub(super) fn claim_stretches_marked<const HELD: bool>(&self, r: Reservation, each: impl FnMut(u32, usize)) {
        self.claim_marked::<HELD>(r, Stretches(each));
    }

    /// [`claim`](Self::claim) what `r` reserved, handing each word's claimed bits to
    /// `each` (word, bits) instead of writing indices (index `w * 64 + b + 1` is bit `b`
    /// of word `w`). One walk in address order from the hint (or this thread's
    /// cursor): free bits from the words and, in a pool that parks, parked blocks as
    /// it meets them ("Parked blocks").
    pub(crate) fn claim_with(&self, r: Reservation, each: impl FnMut(usize, u64)) {
        self.claim_marked::<true>(r, each)
    }

    /// [`claim_with`](Self::claim_with); `HELD`: mark the claimed indices held (a
    /// bare allocation), or leave them unheld (an owned batch, "Owned batches").
    #[inline]
    pub(super) fn claim_marked<const HELD: bool>(&self, r: Reservation, mut each: impl Claimed) {
        let n = r.len();
        let nwords = self.words.len();
        if n == 0 || nwords == 0 {
            return;
        }
        let slot = thread_slot();
        let shard = &self.shards[slot % SHARDS];
        let gauge = &shard.spread;
        let mut spread = gauge.load(untracked::Ordering::Relaxed) != 0 || !self.own_hint(slot, shard);
        let start =
            if spread { shard_cursor(shard, slot, nwords) } else { self.hint.load(Ordering::Relaxed).min(nwords - 1) };
        let mut filled = 0;
        let mut w = start;
        let mut scanned = 0usize;
        let mut last_word = start;
        // Guided by the summary until a whole pass comes up short.
        let mut guided = true;
        // Words this claim emptied, not yet cleared in the summary.
        let mut emptied = SummaryBits::default();
        // Placement (see "Placement"): while a claim still needs a whole word or more,
        // its first pass skips sparse words, and the lowest word it skipped.
        let mut picky = n >= BITS;
        let mut skipped = usize::MAX;
        // In a pool that parks: the parked blocks met on the way, and what is left of
        // the reservation's word part (word bits beyond it belong to other claims).
        let mut blocks = self.parks.then(|| self.block_walk(r, start));
        let mut words_left = r.words;
        loop {
            if let Some(bw) = blocks.as_mut() {
                // Parked blocks below `w` come first.
                let got = self.claim_blocks_below(bw, w / park::BLOCK_WORDS, guided, n - filled, &mut each);
                if got > 0 {
                    filled += got;
                    last_word = last_word.max(bw.last_word);
                    if filled == n {
                        break;
                    }
                }
                if words_left == 0 {
                    // The rest comes from the blocks this claim holds.
                    break;
                }
            }
            let want = (n - filled).min(words_left);
            let word = &self.words[w];
            let mut cur = word.load(Ordering::Relaxed);
            if cur == 0 && guided {
                cur = self.unmark_empty(w);
            } else if cur != 0 && !guided {
                self.mark(SummaryBits::of(w));
            }
            if picky && cur != 0 && n - filled >= BITS && sparse(cur) {
                skipped = skipped.min(w);
                cur = 0;
            }
            let mut lost = false;
            if cur != 0 && want >= BITS {
                // We need the whole word, whatever it holds: take every free bit with
                // one `swap(0)`, which cannot fail (a large claim, e.g. hundreds of
                // thousands of pages at page size 1, pays no compare-and-swap retry and
                // no count of the bits it is about to take). It returns what was free
                // at that instant: `cur`, or fewer bits if another thread claimed some
                // meanwhile, or more if one freed some; at most 64 <= what we need.
                // AcqRel as for the compare-and-swap below.
                let take = word.swap(0, Ordering::AcqRel);
                // The word is empty now: its summary bit goes with this claim's others.
                if let Some(done) = emptied.add(w) {
                    self.unmark_emptied(done);
                }
                if take != 0 {
                    if HELD {
                        self.set_held(w, take);
                    }
                    each.word(w, take);
                    let got = ones(take);
                    filled += got;
                    words_left -= got;
                    last_word = w;
                }
                lost = take != cur;
                cur = 0;
            }
            while cur != 0 {
                let (take, got) = lowest_bits_counted(cur, want);
                // AcqRel: Acquire pairs with the Release of the free that set these
                // bits (the previous owner's writes happen-before ours); Release keeps
                // our earlier claims ordered before anything that observes this word.
                // Strong: a spurious failure would read as contention.
                match word.compare_exchange(cur, cur & !take, Ordering::AcqRel, Ordering::Relaxed) {
                    Ok(_) => {
                        if cur == take {
                            if let Some(done) = emptied.add(w) {
                                self.unmark_emptied(done);
                            }
                        }
                        if HELD {
                            self.set_held(w, take);
                        }
                        each.word(w, take);
                        filled += got;
                        words_left -= got;
                        last_word = w;
                        break;
                    }
                    // Another thread claimed or freed bits of this word meanwhile:
                    // retry with what is there now.
                    Err(actual) => {
                        cur = actual;
                        lost = true;
                    }
                }
            }
            if filled == n {
                break;
            }
            if lost && !spread {
                // Another thread works here: take the rest from our home word on, and
                // have every claim do so until the contention dies down.
                spread = true;
                gauge.store(SPREAD_ROUNDS, untracked::Ordering::Relaxed);
                w = shard_cursor(shard, slot, nwords);
                scanned += 1;
                if let Some(bw) = blocks.as_mut() {
                    self.restart_block_walk(bw, w, guided);
                }
            } else {
                // The next candidate word: past unmarked (allocated) words at 64 per
                // summary load, counting them as scanned.
                let next = if guided { self.next_marked(w + 1) } else { w + 1 };
                scanned += next - w;
                if next >= nwords {
                    w = 0;
                    // The blocks above the last word, then from the beginning.
                    if let Some(bw) = blocks.as_mut() {
                        filled += self.claim_blocks_below(bw, usize::MAX, guided, n - filled, &mut each);
                        if filled == n {
                            break;
                        }
                        self.restart_block_walk(bw, 0, guided);
                    }
                } else {
                    w = next;
                }
            }
            // A countdown, not `scanned % nwords`: a division per scanned word was a
            // fifth of a page-size-1 replay's time.
            if scanned >= nwords && picky {
                // A full pass without the sparse words found too little: take them.
                scanned = 0;
                picky = false;
            } else if scanned >= nwords {
                // A full pass found too little: other threads are claiming and
                // freeing the bits we are entitled to, or the summary missed a word.
                // Let them run, and scan every word from now on.
                scanned = 0;
                guided = false;
                spin_loop();
            }
        }
        self.unmark_emptied(emptied);
        if let Some(mut bw) = blocks {
            // What the blocks' part still owes, and what this claim holds and did not use.
            self.finish_block_walk(&mut bw, n - filled, words_left, &mut each);
        }
        // Single-threaded, words start..last_word were emptied: move the hint there,
        // unless a free lowered it meanwhile. A spread claim scanned elsewhere and says
        // nothing about the words above the hint; it moves its shard's cursor instead.
        if spread {
            if last_word != start {
                shard.cursor.store(last_word, untracked::Ordering::Relaxed);
            }
        } else if last_word != start {
            // Not past a sparse word left behind: the next claims need it.
            let to = if (start..last_word).contains(&skipped) { skipped } else { last_word };
            let _ = self.hint.compare_exchange(start, to, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// Whether the calling thread may claim from the hint: it owns the hint (and counts
    /// the claim, so that others see it is active), or takes it over because nobody
    /// owns it or its owner has not claimed since this shard last looked. Otherwise
    /// the shard spreads for [`SPREAD_ROUNDS`] reservations. All plain loads and
    /// stores: the owner's line is written by its owner and read by the others only
    /// once per [`SPREAD_ROUNDS`] of their reservations.
    #[inline]
    fn own_hint(&self, slot: usize, shard: &Shard) -> bool {
        let me = (slot as u64) << 32;
        let owner = self.hint_owner.load(untracked::Ordering::Relaxed);
        if owner != NO_OWNER && owner & !u64::from(u32::MAX) == me {
            let claims = owner.wrapping_add(1) & u64::from(u32::MAX);
            self.hint_owner.store(me | claims, untracked::Ordering::Relaxed);
            return true;
        }
        if owner == NO_OWNER || owner == shard.seen_owner.load(untracked::Ordering::Relaxed) {
            // Take over. The old owner sees it at its next claim and spreads. Threads
            // that spread did not lower the hint: start again from word 0.
            if owner != NO_OWNER {
                self.hint.store(0, Ordering::Relaxed);
            }
            self.hint_owner.store(me, untracked::Ordering::Relaxed);
            return true;
        }
        // Another thread is claiming from the hint: work elsewhere for a while.
        shard.seen_owner.store(owner, untracked::Ordering::Relaxed);
        shard.spread.store(SPREAD_ROUNDS, untracked::Ordering::Relaxed);
        false
    }

    /// Free a batch of indices.
    ///
    /// A batch of up to [`magazine_capacity`](Self::magazine_capacity) indices goes onto
    /// the calling thread's magazine (which is first returned to the bitmap whole if
    /// the batch does not fit on top); a larger one, or any batch while the magazine is
    /// in use by another thread of the same shard, to the bitmap. Either way every
    /// index is checked first: double frees of indices sitting in a magazine are
    /// refused like any other.
    ///
    /// # Errors
    ///
    /// [`FreeError`] naming the first index that is out of range or not allocated, or
    /// else an index the batch names twice; nothing is freed then. See that type for
    /// the one exception (two threads freeing the same index at once).
    ///
    /// # Examples
    ///
    /// ```
    /// let pool = kvpool::SlotPool::new(4);
    /// let a = [pool.alloc_one()?, pool.alloc_one()?];
    /// assert!(pool.free(&[a[0], a[1], a[0]]).is_err()); // a repeat: nothing freed
    /// assert_eq!(pool.available(), 2);
    /// pool.free(&a)?;
    /// pool.free(&[])?;                       // freeing nothing is fine
    /// assert!(pool.free(&[9]).is_err());     // out of range
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn free(&self, indices: &[u32]) -> Result<(), FreeError> {
        if !indices.is_empty() && indices.len() <= self.mag_cap {
            if let Some(guard) = self.my_magazine().and_then(Magazine::try_take) {
                let r = self.free_to_magazine(&guard, indices);
                drop(guard);
                crate::debug_check(self);
                return r;
            }
        }
        let r = self.release_slice(indices);
        let (n, err) = match r {
            Ok(n) => (n, None),
            Err((n, e)) => (n, Some(e)),
        };
        self.publish(n);
        crate::debug_check(self);
        err.map_or(Ok(()), Err)
    }

    /// Free `indices` (at most `mag_cap`) into the magazine we hold: validate, make
    /// room (flush the magazine to the bitmap if the batch does not fit on top), clear
    /// their held bits (one `fetch_and` per run: the decisive step, which two racing
    /// frees of one index cannot both win), and push the indices this free won, in
    /// batch order.
    fn free_to_magazine(&self, guard: &MagazineGuard<'_>, indices: &[u32]) -> Result<(), FreeError> {
        // 1. Validate: nothing changes unless every index is in range and handed out.
        // The runs go to a stack buffer (left uninitialised, as in `release_slice`), so
        // that applying them does not cut the batch into runs a second time.
        let mut runs = [MaybeUninit::<(usize, u64)>::uninit(); RUN_BUF];
        let mut buffered = 0;
        let mut simple = true; // every run buffered
        let mut repeats = RepeatCheck::default();
        let mut pos = 0;
        while pos < indices.len() {
            let run = self.next_run(indices, pos)?;
            let free = self.not_held(run.word, run.mask);
            if free != 0 {
                let index = indices[pos..run.end]
                    .iter()
                    .copied()
                    .find(|&i| Self::locate(i).1 & free != 0)
                    .unwrap_or(indices[pos]);
                return Err(FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: false });
            }
            repeats.run(&run, indices, pos, simple.then_some(&runs[..buffered]));
            if buffered == RUN_BUF {
                simple = false;
            } else {
                runs[buffered].write((run.word, run.mask));
                buffered += 1;
            }
            pos = run.end;
        }
        if let Some(index) = repeats.finish(self, indices) {
            // An index named twice: refused whole, as a double free.
            return Err(FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: false });
        }
        // 2. Room: a full magazine goes back to the bitmap whole (the depot).
        let mut len = guard.len();
        if len + indices.len() > self.mag_cap {
            self.flush(guard);
            len = 0;
        }
        // 3. Apply: clear the held bits run by run (Relaxed: see `set_held`). Bits that
        // are already 0 were freed by a racing free since we validated: not ours to
        // push.
        let mut first_dup = None;
        if simple {
            let mut lost = false;
            for run in &mut runs[..buffered] {
                // SAFETY: the validation loop wrote entries `..buffered` (it counts up
                // `buffered` only right after writing `runs[buffered]`).
                let (word, mask) = unsafe { run.assume_init() };
                let won = mask & self.held[word].fetch_and(!mask, Ordering::Relaxed);
                lost |= won != mask;
                run.write((word, won));
            }
            if !lost {
                // The common case: every index is new and appears once: one copy.
                guard.with_slots(|slots| slots[len..len + indices.len()].copy_from_slice(indices));
                guard.set_len(len + indices.len());
                return Ok(());
            }
            // A racing free won some: push the others, run by run as validated.
            guard.with_slots(|slots| {
                let mut pos = 0;
                for run in &runs[..buffered] {
                    // SAFETY: as above; the loop above rewrote each entry in place.
                    let (_, won) = unsafe { run.assume_init() };
                    let Ok(next) = self.next_run(indices, pos) else { break };
                    for &i in &indices[pos..next.end] {
                        if won & Self::locate(i).1 != 0 {
                            slots[len] = i;
                            len += 1;
                        } else if first_dup.is_none() {
                            first_dup = Some(i);
                        }
                    }
                    pos = next.end;
                }
            });
        } else {
            // More runs than the buffer: cut the batch again.
            guard.with_slots(|slots| {
                let mut pos = 0;
                while pos < indices.len() {
                    let Ok(run) = self.next_run(indices, pos) else { break };
                    let won = run.mask & self.held[run.word].fetch_and(!run.mask, Ordering::Relaxed);
                    let mut left = won;
                    for &i in &indices[pos..run.end] {
                        let bit = Self::locate(i).1;
                        if left & bit != 0 {
                            slots[len] = i;
                            len += 1;
                            left &= !bit;
                        } else if first_dup.is_none() {
                            first_dup = Some(i);
                        }
                    }
                    pos = run.end;
                }
            });
        }
        guard.set_len(len);
        match first_dup {
            None => Ok(()),
            Some(index) => Err(FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: true }),
        }
    }

    /// Open a free group: frees through it are published (counted as available) all at
    /// once when the group ends or is dropped. SGLang's `free_group_begin/end`.
    ///
    /// # Examples
    ///
    /// ```
    /// let pool = kvpool::SlotPool::new(4);
    /// let mut a = [0u32; 4];
    /// pool.alloc(&mut a)?;
    /// let mut group = pool.free_group();
    /// group.free(&a[..2])?;
    /// group.free(&a[2..])?;
    /// assert_eq!(pool.available(), 0);       // not yet
    /// assert_eq!(group.end(), 4);
    /// assert_eq!(pool.available(), 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn free_group(&self) -> FreeGroup<'_> {
        FreeGroup { pool: self, pending: 0, pending_blocks: 0, unit: Dup::Strict }
    }

    /// Validate then set the bits of `indices` (without publishing), strict about
    /// duplicates. Returns how many bits went 0 -> 1, and on error also that count.
    #[inline]
    pub(crate) fn release_slice(&self, indices: &[u32]) -> Result<usize, (usize, FreeError)> {
        self.release_slice_then(indices, Dup::Strict, || {})
    }

    /// Validate then set the bits of `indices` (without publishing); `dup` says what
    /// an index named twice is (see [`Dup`]). `validated` runs once the whole batch has
    /// passed validation and before any bit is set (never on a validation error): a
    /// dual allocator releases the window part of the pages there. Returns how many
    /// bits went 0 -> 1, and on error also that count.
    ///
    /// The batch is cut into *runs*: maximal stretches of indices in one word, each
    /// folded into a bit mask. A run of consecutive indices (what lowest-first
    /// allocation hands out) is recognised with a branch-free comparison against an
    /// ascending sequence instead of index by index. Validation costs one load per run;
    /// applying, one read-modify-write per run.
    pub(crate) fn release_slice_then(
        &self,
        indices: &[u32],
        dup: Dup,
        validated: impl FnOnce(),
    ) -> Result<usize, (usize, FreeError)> {
        // 1. Validate: nothing changes unless every index is in range and allocated.
        // The buffer is left uninitialised: zeroing 1 KiB would cost more than freeing
        // a small batch.
        let mut runs = [MaybeUninit::<(usize, u64)>::uninit(); RUN_BUF];
        let mut buffered = 0;
        let mut unbuffered_from = None;
        let mut repeats = RepeatCheck::default();
        let mut pos = 0;
        while pos < indices.len() {
            let run = self.next_run(indices, pos).map_err(|e| (0, e))?;
            let set = self.not_held(run.word, run.mask);
            if set != 0 {
                // The first index of the run whose bit is set: already free.
                let index = indices[pos..run.end]
                    .iter()
                    .copied()
                    .find(|&i| Self::locate(i).1 & set != 0)
                    .unwrap_or(indices[pos]);
                return Err((0, FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: false }));
            }
            if dup == Dup::Strict {
                let earlier = unbuffered_from.is_none().then_some(&runs[..buffered]);
                repeats.run(&run, indices, pos, earlier);
            }
            if buffered < RUN_BUF {
                runs[buffered].write((run.word, run.mask));
                buffered += 1;
            } else if unbuffered_from.is_none() {
                unbuffered_from = Some(pos);
            }
            pos = run.end;
        }
        if let Some(index) = repeats.finish(self, indices) {
            // An index named twice: refused whole, as a double free.
            return Err((0, FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: false }));
        }
        validated();
        // 2. Apply: one fetch_or per run. A bit found set again now was freed by a
        // racing free since we validated.
        let mut acc = Applied::new();
        for run in &runs[..buffered] {
            // SAFETY: the validation loop wrote entries `..buffered` (it counts up
            // `buffered` only right after writing `runs[buffered]`).
            let (word, mask) = unsafe { run.assume_init() };
            self.set_bits(word, mask, dup, &mut acc);
        }
        if let Some(mut pos) = unbuffered_from {
            // Validated above, and a run depends only on the indices and the capacity.
            while let Ok(run) = self.next_run(indices, pos) {
                self.set_bits(run.word, run.mask, dup, &mut acc);
                pos = run.end;
                if pos == indices.len() {
                    break;
                }
            }
        }
        self.settle(&mut acc);
        match acc.first_dup {
            None => Ok(acc.freed),
            Some(index) => Err((acc.freed, FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: true })),
        }
    }

    /// The run of `indices` that starts at `pos`: the stretch of indices in the same
    /// word as `indices[pos]`, stopping before an out-of-range index.
    ///
    /// # Errors
    ///
    /// [`FreeError`] (out of range) when `indices[pos]` itself is.
    #[inline]
    fn next_run(&self, indices: &[u32], pos: usize) -> Result<Run, FreeError> {
        let cap = self.capacity;
        let first = indices[pos];
        // 0 wraps to u32::MAX, so one comparison covers both ends.
        let i = first.wrapping_sub(1);
        if i >= cap {
            let kind = FreeErrorKind::OutOfRange { first: 1, last: cap };
            return Err(FreeError { index: first, kind, rest_freed: false });
        }
        let word = i as usize / BITS;
        let bit = i as usize % BITS;
        // Fast path: the rest of the word, as far as the batch and the capacity go,
        // is a stretch of consecutive indices.
        let room = (BITS - bit).min(indices.len() - pos).min((cap - i) as usize);
        let stretch = &indices[pos..pos + room];
        if room > 1 && stretch[room - 1] == first.wrapping_add(room as u32 - 1) && ascending_from(stretch, first) {
            let mask = if room == BITS { u64::MAX } else { ((1u64 << room) - 1) << bit };
            return Ok(Run { word, mask, end: pos + room, dup: None });
        }
        // Index by index, while the indices stay in this word.
        let mut mask = 1u64 << bit;
        let mut dup = None;
        let mut end = pos + 1;
        while let Some(&index) = indices.get(end) {
            let j = index.wrapping_sub(1);
            if j >= cap || j as usize / BITS != word {
                break;
            }
            let b = 1u64 << (j as usize % BITS);
            if mask & b != 0 && dup.is_none() {
                dup = Some(index);
            }
            mask |= b;
            end += 1;
        }
        Ok(Run { word, mask, end, dup })
    }

    /// A strict free's check for an index named twice, for a batch with more runs
    /// than the stack buffer that comes back to words it passed (a batch in no order):
    /// mark each run's bits in `freeing` with one `fetch_or`, stop at the first run
    /// that finds one of its bits marked already, and unmark what this call marked.
    /// O(runs), and nothing else changes. `indices` passed validation (every run is
    /// in range). Returns the first index (in batch order) of the first run that
    /// clashed.
    ///
    /// Two frees that race on the same index may see each other's marks: the batch
    /// that does is refused as a repeat, which it is across the two (a double free).
    /// Frees of different indices touch different bits and never interfere.
    #[cold]
    fn repeat_by_marks(&self, indices: &[u32]) -> Option<u32> {
        if self.freeing.is_empty() {
            // A KV allocator's page pool, whose frees merge repeats: never reached;
            // still exact.
            debug_assert!(false, "a strict free of a page pool");
            return indices.iter().enumerate().find(|(i, x)| indices[..*i].contains(x)).map(|(_, &x)| x);
        }
        let mut found = None;
        let mut end = 0;
        while end < indices.len() {
            let Ok(run) = self.next_run(indices, end) else { break };
            // Relaxed: the marks order nothing; each bit is one free's until it unmarks.
            let old = self.freeing[run.word].fetch_or(run.mask, Ordering::Relaxed);
            let clash = old & run.mask;
            if clash != 0 {
                // Unmark this run's own bits; the runs before it are unmarked below.
                self.freeing[run.word].fetch_and(!(run.mask & !old), Ordering::Relaxed);
                found = indices[end..run.end].iter().copied().find(|&i| Self::locate(i).1 & clash != 0);
                break;
            }
            end = run.end;
        }
        let mut pos = 0;
        while pos < end {
            let Ok(run) = self.next_run(indices, pos) else { break };
            self.freeing[run.word].fetch_and(!run.mask, Ordering::Relaxed);
            pos = run.end;
        }
        found
    }

    /// Set the bits of `mask` in word `w`; count them and note double frees in `acc`.
    #[inline]
    fn set_bits(&self, w: usize, mask: u64, dup: Dup, acc: &mut Applied) {
        // With magazines, clearing the held bits is the decisive step (a racing free
        // of the same index, into a magazine or here, loses it): only the bits this
        // free wins go on to the bitmap.
        let won = match self.held.get(w) {
            // Relaxed: see `set_held`.
            Some(h) => mask & h.fetch_and(!mask, Ordering::Relaxed),
            None => mask,
        };
        // Release: our writes to whatever the index guards happen-before the next
        // owner's claim (which loads this word with Acquire). SeqCst: the first half of
        // the summary's ordering (see `unmark`).
        let old = if won != 0 { self.words[w].fetch_or(won, Ordering::SeqCst) } else { 0 };
        if won != 0 {
            if let Some(done) = acc.marks.add(w) {
                self.mark(done);
            }
        }
        acc.freed += (won & !old).count_ones() as usize;
        if let Some(b) = self.block_of(w) {
            // Parked blocks: remember what we set in this block, for the generation
            // step when the free leaves the block (`close_block`).
            if b != acc.blk {
                self.close_block(acc);
                acc.blk = b;
            }
            acc.blk_set[w % park::BLOCK_WORDS] |= won & !old;
        }
        let again = (mask & !won) | (won & old);
        if again != 0 && dup == Dup::Strict && acc.first_dup.is_none() {
            acc.first_dup = Some((w * BITS + again.trailing_zeros() as usize + 1) as u32);
        }
        acc.min_word = acc.min_word.min(w);
    }

    /// After a free whose lowest word is `w`: lower the hint to `w` if it is above.
    /// Reads first: a read leaves the cache line shared. A thread that is spreading
    /// leaves the hint to its owner, whose claims move it every round (a takeover
    /// restarts the hint at word 0 instead), and lowers its shard's cursor if `w` lies
    /// between its home and the cursor.
    #[inline]
    fn lower_hint(&self, w: usize) {
        if w == usize::MAX {
            return;
        }
        let slot = thread_slot();
        let shard = &self.shards[slot % SHARDS];
        if shard.spread.load(untracked::Ordering::Relaxed) != 0 {
            let cursor = shard.cursor.load(untracked::Ordering::Relaxed);
            if cursor != NO_CURSOR && w < cursor && w >= home_word(slot, self.words.len()) {
                shard.cursor.store(w, untracked::Ordering::Relaxed);
            }
            return;
        }
        if w < self.hint.load(Ordering::Relaxed) {
            self.hint.fetch_min(w, Ordering::Relaxed);
        }
    }

    /// The end of a free's apply step: the generation step of the last block it set
    /// bits in, then the summary, the hint and the block hint.
    #[inline]
    fn settle(&self, acc: &mut Applied) {
        self.close_block(acc);
        self.mark(acc.marks);
        // A parked block is free indices like any other for the claims' walk.
        self.lower_hint(acc.min_word.min(acc.min_block.saturating_mul(park::BLOCK_WORDS)));
        self.lower_block_hint(acc.min_block);
    }

    /// Validate then set the bits of `indices` (without publishing), for any iterator
    /// of indices (pages of token slots: repeats are the norm there, see [`Dup`]).
    /// `validated` runs as in [`release_slice_then`](Self::release_slice_then).
    /// Returns how many bits went 0 -> 1, and on error also that count. Its callers
    /// merge repeats: with [`Dup::Strict`] it would report a repeat only after freeing
    /// the rest (`rest_freed`), unlike `release_slice_then`.
    pub(crate) fn release<I>(&self, indices: I, dup: Dup, validated: impl FnOnce()) -> Result<usize, (usize, FreeError)>
    where
        I: Iterator<Item = u32> + Clone,
    {
        // 1. Validate: nothing changes unless every index is in range and allocated.
        // An index equal to the one before it was checked already. (`u64::MAX` is no
        // index: a sentinel compares faster than an `Option`.)
        let mut prev = u64::MAX;
        for index in indices.clone() {
            if index as u64 == prev {
                continue;
            }
            if index == 0 || index > self.capacity {
                let kind = FreeErrorKind::OutOfRange { first: 1, last: self.capacity };
                return Err((0, FreeError { index, kind, rest_freed: false }));
            }
            let (w, bit) = Self::locate(index);
            if self.not_held(w, bit) != 0 {
                let kind = FreeErrorKind::NotAllocated;
                return Err((0, FreeError { index, kind, rest_freed: false }));
            }
            prev = index as u64;
        }
        validated();
        // 2. Apply, one fetch_or per run of indices in the same word. Merging, an index
        // equal to the one before it adds nothing (strict, it is a double free).
        let mut acc = Applied::new();
        let mut run_word = usize::MAX;
        let mut run_mask = 0u64;
        let mut prev = u64::MAX;
        for index in indices {
            if dup == Dup::Merge && index as u64 == prev {
                continue;
            }
            prev = index as u64;
            let (w, bit) = Self::locate(index);
            if w != run_word {
                if run_mask != 0 {
                    self.set_bits(run_word, run_mask, dup, &mut acc);
                }
                run_word = w;
                run_mask = 0;
            }
            if run_mask & bit != 0 && dup == Dup::Strict && acc.first_dup.is_none() {
                acc.first_dup = Some(index);
            }
            run_mask |= bit;
        }
        if run_mask != 0 {
            self.set_bits(run_word, run_mask, dup, &mut acc);
        }
        self.settle(&mut acc);
        match acc.first_dup {
            None => Ok(acc.freed),
            Some(index) => Err((acc.freed, FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: true })),
        }
    }

    /// Make `n` freed indices available.
    #[inline]
    pub(crate) fn publish(&self, n: usize) {
        if n > 0 {
            // Release: the bits were set before; a reserver that sees this count
            // (Acquire) sees them.
            self.my_shard().available.fetch_add(n, Ordering::Release);
        }
    }

    /// Free every index at once: the pool is as new. Takes `&mut self`, so no other
    /// operation can be in flight (SGLang calls this when the cache is flushed). Owned
    /// batches ([`Slots`]) filled before are refused from then on
    /// ([`SlotsError::OtherPool`](crate::SlotsError::OtherPool)): their indices are
    /// free again, and the pool does not take them back twice.
    pub fn clear(&mut self) {
        self.fill();
        // Batches filled before are not ours any more.
        self.id = owned::next_pool_id();
    }

    /// Check the pool's invariants in O(capacity). Exact only at quiescence.
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`] if the set bits do not match `available` plus unpublished
    /// frees, or bits past the capacity are set. Either is a kvpool bug.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let cap = self.capacity as usize;
        if let Some(w) = self.freeing.iter().position(|m| m.load(Ordering::Relaxed) != 0) {
            return Err(InvariantViolation(format!("word {w} of a free's repeat marks was left set")));
        }
        let mut ones = 0usize;
        for (w, word) in self.words.iter().enumerate() {
            let v = word.load(Ordering::Acquire);
            let lo = w * BITS;
            let n = (cap - lo).min(BITS);
            if n < BITS && v >> n != 0 {
                return Err(InvariantViolation(format!("word {w} has bits set past capacity {cap}: {v:#x}")));
            }
            ones += v.count_ones() as usize;
            // Not under loom, which models SeqCst accesses as AcqRel and so explores the
            // store-buffering outcome the summary's SeqCst pairs rule out (see
            // `unmark`); there a word can stay unmarked, which the claims'
            // fallback pass covers, and the models check that claims stay correct.
            if !cfg!(loom) && v != 0 && self.summary[w / BITS].load(Ordering::Acquire) & (1 << (w % BITS)) == 0 {
                return Err(InvariantViolation(format!("word {w} has free bits {v:#x} but no summary bit")));
            }
        }
        // In the magazines' stacks and runs, and owned by `Slots` values.
        let mut in_mags = 0usize;
        let mut owned = self.owned_bitmap.load(Ordering::Relaxed);
        for (m, mag) in self.mags.iter().enumerate() {
            let Some(guard) = mag.try_take() else {
                return Err(InvariantViolation(format!("magazine {m} is in use: not quiescent")));
            };
            let len = guard.len();
            if len > self.mag_cap {
                return Err(InvariantViolation(format!("magazine {m} holds {len} > {}", self.mag_cap)));
            }
            let bad = guard.with_slots(|slots| {
                slots[..len].iter().copied().find(|&i| {
                    if i == 0 || i > self.capacity {
                        return true;
                    }
                    let (w, bit) = Self::locate(i);
                    (self.words[w].load(Ordering::Acquire) | self.held[w].load(Ordering::Acquire)) & bit != 0
                })
            });
            if let Some(i) = bad {
                return Err(InvariantViolation(format!(
                    "magazine {m} holds {i}, which is out of range, held or free in the bitmap"
                )));
            }
            in_mags += len;
            in_mags += self.check_runs_magazine(m, &guard)?;
            owned = owned.wrapping_add(mag.owned.load(Ordering::Relaxed));
        }
        if !self.held.is_empty() {
            let mut held = 0usize;
            for (w, (h, word)) in self.held.iter().zip(self.words.iter()).enumerate() {
                let (h, v) = (h.load(Ordering::Acquire), word.load(Ordering::Acquire));
                let n = (cap - w * BITS).min(BITS);
                if h & v != 0 || (n < BITS && h >> n != 0) {
                    return Err(InvariantViolation(format!(
                        "word {w}: held {h:#x} overlaps free {v:#x} or passes capacity"
                    )));
                }
                held += h.count_ones() as usize;
            }
            if held + ones + in_mags + owned != cap {
                return Err(InvariantViolation(format!(
                    "{held} held + {ones} free in the bitmap + {in_mags} in magazines + {owned} in Slots != capacity {cap}"
                )));
            }
        }
        let (parked, dirty, reservable) = self.parked_census();
        if let Some(b) = dirty {
            return Err(InvariantViolation(format!("block {b} is parked but its words hold free bits")));
        }
        if reservable > parked {
            return Err(InvariantViolation(format!("{reservable} parked blocks counted but {parked} parked")));
        }
        let ones = ones + parked * park::BLOCK;
        let avail = self.available().saturating_sub(in_mags);
        let unpub = self.unpublished.load(Ordering::Acquire);
        if ones != avail + unpub {
            return Err(InvariantViolation(format!(
                "{ones} free (bits and {parked} parked blocks) but available {avail} + unpublished {unpub}"
            )));
        }
        if avail > cap {
            return Err(InvariantViolation(format!("available {avail} exceeds capacity {cap}")));
        }
        Ok(())
    }
}

impl core::fmt::Debug for SlotPool {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SlotPool").field("capacity", &self.capacity).field("available", &self.available()).finish()
    }
}

/// One run of a free batch: indices `..end` of the batch lie in `word`, at `mask`.
struct Run {
    word: usize,
    mask: u64,
    /// Batch position after the run.
    end: usize,
    /// The first index repeated inside the run.
    dup: Option<u32>,
}

/// A strict free's check for an index named twice in its batch, run by run while the
/// batch is validated, so that a repeat refuses the whole batch before anything
/// changes. A repeat inside one run is the run's own `dup`. One across runs needs a
/// run that comes back to a word at or below the highest word before it: checked
/// against the runs buffered on the stack, or, past the buffer, by
/// [`SlotPool::repeat_by_marks`] once the loop is done.
#[derive(Default)]
struct RepeatCheck {
    /// One past the highest word of the runs so far (0 before the first run).
    top: usize,
    /// A run came back below `top` past the buffered runs.
    deferred: bool,
    /// The repeated index found.
    found: Option<u32>,
}

impl RepeatCheck {
    /// Note `run` (`indices[pos..run.end]`); `earlier` holds every run before it, or
    /// is `None` when some were not buffered.
    #[inline]
    fn run(&mut self, run: &Run, indices: &[u32], pos: usize, earlier: Option<&[MaybeUninit<(usize, u64)>]>) {
        if self.found.is_some() {
            return;
        }
        if run.dup.is_some() {
            self.found = run.dup;
            return;
        }
        let back = run.word < self.top;
        self.top = self.top.max(run.word + 1);
        if !back {
            return;
        }
        let Some(earlier) = earlier else {
            self.deferred = true;
            return;
        };
        let clash = earlier.iter().fold(0u64, |acc, r| {
            // SAFETY: the callers pass only the entries their validation loop wrote
            // (`runs[..buffered]`, counted up right after each write).
            let (w, m) = unsafe { r.assume_init() };
            if w == run.word {
                acc | (m & run.mask)
            } else {
                acc
            }
        });
        if clash != 0 {
            self.found = indices[pos..run.end].iter().copied().find(|&i| SlotPool::locate(i).1 & clash != 0);
        }
    }

    /// After the loop: the repeated index, if any.
    fn finish(self, pool: &SlotPool, indices: &[u32]) -> Option<u32> {
        match self.found {
            None if self.deferred => pool.repeat_by_marks(indices),
            found => found,
        }
    }
}

/// What applying a free batch did so far.
struct Applied {
    freed: usize,
    /// The first index found free again while applying: freed by a racing free since
    /// the validation (or, in a strict [`SlotPool::release`], named twice).
    first_dup: Option<u32>,
    min_word: usize,
    /// Words set so far whose summary bits are still to be set, with one summary
    /// access per 64 words ([`SlotPool::mark`]), after the free's RMWs on them.
    marks: SummaryBits,
    /// The block (of a pool that parks blocks) the last words set lie in, or
    /// `usize::MAX`, and the bits this free set in each of its words.
    blk: usize,
    blk_set: [u64; park::BLOCK_WORDS],
    /// Blocks this free parked, and the lowest of them.
    parked: usize,
    min_block: usize,
}

impl Applied {
    fn new() -> Self {
        Applied {
            freed: 0,
            first_dup: None,
            min_word: usize::MAX,
            marks: SummaryBits::default(),
            blk: usize::MAX,
            blk_set: [0; park::BLOCK_WORDS],
            parked: 0,
            min_block: usize::MAX,
        }
    }

    /// Whether this free has freed anything so far (bits or parked blocks).
    fn freed_any(&self) -> bool {
        self.freed > 0 || self.parked > 0
    }
}

/// Words of `words` within one word of the summary, gathered so that a run of them
/// costs one summary access: bit `k` is word `sw * 64 + k`.
#[derive(Clone, Copy, Default)]
struct SummaryBits {
    sw: usize,
    bits: u64,
}

impl SummaryBits {
    /// Word `w` alone.
    fn of(w: usize) -> Self {
        SummaryBits { sw: w / BITS, bits: 1 << (w % BITS) }
    }

    /// Add word `w`. When it lies in another summary word than the words gathered so
    /// far, those are returned, to be applied now, and the gathering restarts at `w`.
    #[inline]
    fn add(&mut self, w: usize) -> Option<SummaryBits> {
        let next = SummaryBits::of(w);
        if next.sw == self.sw {
            self.bits |= next.bits;
            return None;
        }
        let done = core::mem::replace(self, next);
        (done.bits != 0).then_some(done)
    }
}

/// Call `f(word, mask)` for each stretch of `indices` (all valid) that lies in one
/// bitmap word, in order: one call per word for indices that lowest-first allocation
/// handed out, a vectorised comparison recognising a consecutive stretch.
#[inline]
fn for_each_run(indices: &[u32], mut f: impl FnMut(usize, u64)) {
    let mut pos = 0;
    while pos < indices.len() {
        let first = indices[pos];
        let i = first as usize - 1;
        let (word, bit) = (i / BITS, i % BITS);
        let room = (BITS - bit).min(indices.len() - pos);
        let stretch = &indices[pos..pos + room];
        if room > 1 && stretch[room - 1] == first.wrapping_add(room as u32 - 1) && ascending_from(stretch, first) {
            f(word, if room == BITS { u64::MAX } else { ((1u64 << room) - 1) << bit });
            pos += room;
            continue;
        }
        let mut mask = 1u64 << bit;
        pos += 1;
        while let Some(&index) = indices.get(pos) {
            let j = index as usize - 1;
            if j / BITS != word {
                break;
            }
            mask |= 1u64 << (j % BITS);
            pos += 1;
        }
        f(word, mask);
    }
}

/// Whether `s` is `first, first + 1, ...`. No early exit, so the compiler vectorises it.
#[inline]
pub(crate) fn ascending_from(s: &[u32], first: u32) -> bool {
    let mut diff = 0u32;
    for (k, &x) in s.iter().enumerate() {
        diff |= x ^ first.wrapping_add(k as u32);
    }
    diff == 0
}

/// Take `n` off `counter` if it holds that many: `Ok(whether a compare-and-swap lost
/// to another thread on the way)`, or `Err(what it held)` with nothing changed.
#[inline]
fn take(counter: &AtomicUsize, n: usize) -> Result<bool, usize> {
    let mut backoff = Backoff::new();
    let mut cur = counter.load(Ordering::Relaxed);
    let mut lost = false;
    loop {
        if cur < n {
            return Err(cur);
        }
        // Acquire: the frees that published these indices set their bits before their
        // Release increment; after this we see those bits. Strong, not weak: a
        // spurious failure would read as contention.
        match counter.compare_exchange(cur, cur - n, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => return Ok(lost),
            Err(actual) => {
                // Another thread reserved, published or swept in between.
                cur = actual;
                lost = true;
                backoff.spin();
            }
        }
    }
}

/// Update a shard's contention gauge after a reservation: a plain load and, while the
/// gauge is up, a store, on a cache line that the shard's thread normally has to
/// itself. Racing updates only make the heuristic a little less precise.
#[inline]
fn gauge_contention(shard: &Shard, lost: bool) {
    let s = shard.spread.load(untracked::Ordering::Relaxed);
    if lost {
        if s != SPREAD_ROUNDS {
            shard.spread.store(SPREAD_ROUNDS, untracked::Ordering::Relaxed);
        }
    } else if s != 0 {
        shard.spread.store(s - 1, untracked::Ordering::Relaxed);
    }
}

/// Where a spreading claim starts: the shard's cursor, or the thread's home word before
/// the shard's first spreading claim.
#[inline]
fn shard_cursor(shard: &Shard, slot: usize, nwords: usize) -> usize {
    match shard.cursor.load(untracked::Ordering::Relaxed) {
        c if c < nwords => c,
        _ => home_word(slot, nwords),
    }
}

/// Where a thread starts its claims while threads contend: its slot (`slot + 1`, so
/// that no thread's home is word 0, where lowest-first claims work) spread over the
/// bitmap by Fibonacci hashing, aligned down to a cache line of words so that two
/// threads seldom share a line.
#[inline]
fn home_word(slot: usize, nwords: usize) -> usize {
    let h = ((slot as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 32;
    let w = ((h * nwords as u64) >> 32) as usize;
    w & !(WORDS_PER_LINE - 1)
}

/// The number of set bits of `v`, with a shortcut for a full word: without a
/// `target-cpu` the compiler has no `popcnt` and counts in software.
#[inline]
fn ones(v: u64) -> usize {
    if v == u64::MAX {
        BITS
    } else {
        v.count_ones() as usize
    }
}

/// The indices a single thread's claim of `n` takes from a pool whose free indices
/// (`1..`, any order) are `free`, for the sequential models and reference pools: words
/// in ascending order, the lowest bits of each, but while 64 or more are still needed
/// a sparse word is passed over, and taken in a second pass if the first comes up
/// short ("Placement"). `n` must not exceed the free count.
pub(crate) fn placement(free: impl IntoIterator<Item = u32>, n: usize) -> Vec<u32> {
    let mut words = Vec::<u64>::new();
    for i in free {
        let (w, b) = ((i - 1) as usize / BITS, (i - 1) as usize % BITS);
        if w >= words.len() {
            words.resize(w + 1, 0);
        }
        words[w] |= 1 << b;
    }
    let mut out = Vec::with_capacity(n);
    for picky in [true, false] {
        for (r, bits) in words.iter_mut().enumerate() {
            let need = n - out.len();
            if need == 0 {
                break;
            }
            if *bits == 0 || (picky && need >= BITS && sparse(*bits)) {
                continue;
            }
            while out.len() < n && *bits != 0 {
                out.push((r * BITS) as u32 + bits.trailing_zeros() + 1);
                *bits &= *bits - 1;
            }
        }
    }
    out
}

/// Whether the free bits `v` (not 0) are too scattered for a claim that needs a whole
/// word or more (see "Placement"): the stretches of consecutive bits strictly inside
/// the word are shorter than [`SPARSE_STRETCH`] on average. A stretch that reaches
/// the word's bottom or top bit may go on in the neighbouring word, so it is not
/// judged.
#[inline]
pub(crate) fn sparse(v: u64) -> bool {
    if v == u64::MAX {
        return false;
    }
    // Both below 64: some bit is clear.
    let inner = v & (u64::MAX << v.trailing_ones()) & (u64::MAX >> v.leading_ones());
    // A stretch starts at each set bit whose lower neighbour is clear.
    let stretches = (inner & !(inner << 1)).count_ones();
    inner.count_ones() < SPARSE_STRETCH * stretches
}

/// The average length of a word's free stretches below which a large claim leaves
/// the word to smaller ones (see "Placement").
const SPARSE_STRETCH: u32 = 8;

/// The lowest `min(n, ones(v))` set bits of `v`, and how many that is; `n >= 1`.
/// A stretch of consecutive bits (what lowest-first claims leave) is counted from
/// its ends instead of with a population count.
#[inline]
fn lowest_bits_counted(v: u64, n: usize) -> (u64, usize) {
    debug_assert!(v != 0 && n != 0);
    let tz = v.trailing_zeros();
    let run = (v >> tz).trailing_ones() as usize;
    if run >= n {
        // The lowest n bits are one stretch.
        return ((u64::MAX >> (BITS - n)) << tz, n);
    }
    if v >> tz >> run == 0 {
        // All of v is that one shorter stretch: take all of it.
        return (v, run);
    }
    let take = lowest_bits(v, n);
    (take, ones(take))
}

/// The lowest `n` set bits of `v` (all of them when `n >= v.count_ones()`).
#[inline]
fn lowest_bits(v: u64, n: usize) -> u64 {
    if n == 0 || v == 0 {
        return 0;
    }
    // Usually the lowest free bits are one stretch (lowest-first allocation).
    let tz = v.trailing_zeros();
    if (v >> tz).trailing_ones() as usize >= n {
        return (u64::MAX >> (BITS - n.min(BITS))) << tz;
    }
    let mut v = v;
    let mut m = 0u64;
    for _ in 0..n {
        let low = v & v.wrapping_neg();
        m |= low;
        v ^= low;
    }
    m
}

/// Where a claim puts what it takes ([`SlotPool::claim_marked`]): the claimed bits of
/// one word at a time, or whole words in a row (a parked block handed out whole), which
/// a receiver of stretches takes as one stretch instead of one per word. Any
/// `FnMut(word, bits)` is one.
pub(super) trait Claimed {
    /// Bits `bits` of word `w` (index `w * 64 + b + 1` is bit `b`).
    fn word(&mut self, w: usize, bits: u64);

    /// Every bit of words `w..w + count`.
    #[inline]
    fn whole(&mut self, w: usize, count: usize) {
        for k in w..w + count {
            self.word(k, u64::MAX);
        }
    }
}

impl<F: FnMut(usize, u64)> Claimed for F {
    #[inline]
    fn word(&mut self, w: usize, bits: u64) {
        self(w, bits)
    }
}

/// A [`Claimed`] writing the claimed indices into `out` in claim order
/// ([`SlotPool::claim`]).
struct Indices<'a> {
    out: &'a mut [u32],
    filled: usize,
}

impl Claimed for Indices<'_> {
    #[inline]
    fn word(&mut self, w: usize, bits: u64) {
        self.filled += write_indices(bits, w, &mut self.out[self.filled..]);
    }

    #[inline]
    fn whole(&mut self, w: usize, count: usize) {
        let n = count * BITS;
        crate::iota::fill_ascending(&mut self.out[self.filled..self.filled + n], (w * BITS + 1) as u32);
        self.filled += n;
    }
}

/// A [`Claimed`] handing the claimed indices on as stretches `(first, count)` of
/// consecutive indices ([`SlotPool::claim_stretches`]).
struct Stretches<F>(F);

impl<F: FnMut(u32, usize)> Claimed for Stretches<F> {
    #[inline]
    fn word(&mut self, w: usize, bits: u64) {
        let base = (w * BITS + 1) as u32;
        if bits == u64::MAX {
            // A whole word (most of a long claim's): one stretch, no bit scan.
            (self.0)(base, BITS);
            return;
        }
        let mut t = bits;
        while t != 0 {
            let b = t.trailing_zeros();
            let count = (!(t >> b)).trailing_zeros();
            (self.0)(base + b, count as usize);
            let end = b + count;
            t = if end >= BITS as u32 { 0 } else { t & (!0u64 << end) };
        }
    }

    #[inline]
    fn whole(&mut self, w: usize, count: usize) {
        if count > 0 {
            (self.0)((w * BITS + 1) as u32, count * BITS);
        }
    }
}

/// Write the indices of the bits of `mask` in word `w` to `out`, ascending; returns
/// how many.
#[inline]
fn write_indices(mask: u64, w: usize, out: &mut [u32]) -> usize {
    let base = (w * BITS + 1) as u32;
    let tz = mask.trailing_zeros();
    let stretch = mask >> tz;
    if stretch & stretch.wrapping_add(1) == 0 {
        // One stretch of consecutive bits (a full word included): a vectorised fill.
        // Its length is its bit length (no population count needed).
        let n = BITS - stretch.leading_zeros() as usize;
        crate::iota::fill_ascending(&mut out[..n], base + tz);
        return n;
    }
    let mut m = mask;
    let mut i = 0;
    while m != 0 {
        out[i] = base + m.trailing_zeros();
        m &= m - 1;
        i += 1;
    }
    i
}

/// Words a claim must empty in one summary word for it to clear their summary bits
/// itself (see [`SlotPool::unmark_emptied`]).
const UNMARK_MIN: usize = 8;

/// A batch of frees published together: SGLang's `free_group_begin` ..
/// `free_group_end`. The freed indices do not count as available until the group
/// ends ([`end`](FreeGroup::end) or drop), and then all at once.
///
/// Other threads may still be handed the group's indices before it ends — they are
/// free — but the *count* of allocatable indices only grows at the end, so an
/// allocation that needs the group's frees fails until then.
///
/// A group's frees go to the bitmap, never to a magazine (a magazine's entries count
/// as available at once).
#[must_use = "a free group publishes its frees when it ends; dropping it at once is a plain free"]
pub struct FreeGroup<'a> {
    pool: &'a SlotPool,
    /// Indices freed into the bitmap words, not yet published.
    pending: usize,
    /// Blocks parked, not yet published.
    pending_blocks: usize,
    unit: Dup,
}

impl<'a> FreeGroup<'a> {
    /// Free `indices` into the group.
    ///
    /// # Errors
    ///
    /// As [`SlotPool::free`].
    pub fn free(&mut self, indices: &[u32]) -> Result<(), FreeError> {
        self.free_then(indices, || {})
    }

    /// A group whose batches may name an index more than once: it is freed once and
    /// the repeats are no error ([`Dup::Merge`]), so a batch is all or nothing. For the
    /// KV allocators, which free the distinct pages a batch of slots lies in.
    pub(crate) fn merging(pool: &'a SlotPool) -> Self {
        FreeGroup { pool, pending: 0, pending_blocks: 0, unit: Dup::Merge }
    }

    /// [`free`](Self::free), running `validated` once the whole batch has passed
    /// validation, before anything is freed (not at all on a validation error).
    pub(crate) fn free_then(&mut self, indices: &[u32], validated: impl FnOnce()) -> Result<(), FreeError> {
        let r = self.pool.release_slice_then(indices, self.unit, validated);
        self.account(r)
    }

    /// [`free_then`](Self::free_then) for any iterator of indices.
    pub(crate) fn free_iter_then<I>(&mut self, indices: I, validated: impl FnOnce()) -> Result<(), FreeError>
    where
        I: Iterator<Item = u32> + Clone,
    {
        let r = self.pool.release(indices, self.unit, validated);
        self.account(r)
    }

    /// Hold back what a release set; pass its error on.
    fn account(&mut self, r: Result<usize, (usize, FreeError)>) -> Result<(), FreeError> {
        let (n, err) = match r {
            Ok(n) => (n, None),
            Err((n, e)) => (n, Some(e)),
        };
        if n > 0 {
            self.pool.unpublished.fetch_add(n, Ordering::Relaxed);
            self.pending += n;
        }
        err.map_or(Ok(()), Err)
    }

    /// Hold back the blocks a release parked.
    fn account_parked(&mut self, blocks: usize) {
        if blocks > 0 {
            self.pool.unpublished.fetch_add(blocks * park::BLOCK, Ordering::Relaxed);
            self.pending_blocks += blocks;
        }
    }

    /// Frees held back so far.
    pub fn pending(&self) -> usize {
        self.pending + self.pending_blocks * park::BLOCK
    }

    /// End the group, publishing its frees at once; returns how many.
    pub fn end(mut self) -> usize {
        self.finish()
    }

    fn finish(&mut self) -> usize {
        let n = core::mem::take(&mut self.pending);
        let blocks = core::mem::take(&mut self.pending_blocks);
        self.pool.publish(n);
        self.pool.publish_parked(blocks);
        let total = n + blocks * park::BLOCK;
        if total > 0 {
            self.pool.unpublished.fetch_sub(total, Ordering::Relaxed);
        }
        crate::debug_check(self.pool);
        total
    }
}

impl Drop for FreeGroup<'_> {
    fn drop(&mut self) {
        self.finish();
    }
}

impl core::fmt::Debug for FreeGroup<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("FreeGroup").field("pending", &self.pending()).finish()
    }
}

pub mod cache;
mod follow;
pub mod owned;
mod park;
mod range;
pub use cache::SlotCache;
pub use owned::Slots;
pub(crate) use range::{bit_ends, bit_words};

#[cfg(all(test, not(loom)))]
mod tests;

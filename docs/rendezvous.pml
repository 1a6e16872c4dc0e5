/*
 * The round protocol of elastic.run (src/elastic/recovery/rendezvous.py: `step`, `decide`, and the
 * Rendezvous' `_reseed`, `_monitor`/`_follow`, `_retry`), as a SPIN model, with the two events of a
 * cluster that the protocol must survive: the store lost and restarted EMPTY, and a pair of live
 * participants that reach the store but not each other.
 *
 * THE PROTOCOL AS MODELLED. Three participants 0, 1, 2 (ranks in id order). A member of generation g
 * trains until its generation is broken (a member crashed or went on to a later round: a collective fails)
 * or pending() (from the store: round g+1 decided, joined (by a newcomer: if there is room under
 * max_workers), its evidence, a member that looks dead to the monitor, or the re-seed's stale flag).
 * Then it joins round g+1, one store operation per step as `step` does:
 *   FIN      fin + hint: round = max(round, next)             SCAN    skip decided rounds (d/<n> exists)
 *            (a member of generation n-1 skips hint and scan: it joins round n at once, and a decided
 *            round n leaves it out: a straggler)
 *   JOIN     slot + put (+me), and the previous generation when it is its own (n-1 == its generation;
 *            round 0: an orphan)                              PREV    prev + prevall: d/<n-1> and its
 *            members, none (an orphan round) in a restarted store
 *   LEAD     compare_set lead/<n>: the leader, or a waiter of the leader it finds
 *   POLL     the leader's poll + count + read + judge, as ONE step reading the round's events at once; it
 *            waits (blocks) while the judgement is "not yet" (a poll that would find the same answer)
 *   GUARD    orphan rounds only: next > n -> the round is obsolete, join n+1 (from fin)
 *   COMMIT   compare_set d/<n> (propose, m/<n>/<me>, is folded into the judgement: it is read only through
 *            d/<n>, written before it and lost with it)
 *   WAIT     a waiter's wait + wake + sleep, until d/<n> exists, or its leader looks gone -> TAKEOVER
 *            (compare_set lead/<n> from that leader; a wrong judgement gives two leaders, one d/<n>)
 *   HINTED   the committer raises next to n+1 (raise_to), then trains; a waiter reading the decision
 *            trains at once; a participant the decision excludes is a straggler: it joins n+1 (from fin)
 * decide(): the candidates are the joiners (a joiner is alive); the round waits for every live member
 * of the previous generation P that has not joined (unless P's joined members fill max_workers); it closes
 * at once with max_workers candidates; a round with no member of P among its candidates waits for a quiet
 * last call (see the timing assumption); min_workers = first_workers = 1.
 *
 * THE STORE RESTARTED EMPTY (environment, any moment): every key gone at once (d/, r/, lead/, next,
 * epoch, the evidence). Each live participant's next store operation fails; its client reconnects, finds
 * another epoch and re-seeds (two steps: m/<g>/me and compare_set d/<g> with its generation's members,
 * the stale flag when another list got there first; then next raised to g); a join in progress starts
 * again from fin at round g+1. Training participants re-seed from their heartbeat thread (the same steps).
 * TIMING ASSUMPTION, explicit: a quiet wait (last_call, 1 s) outlasts the members' re-seed (a few
 * heartbeat periods after the store is back). Modelled as: a judgement that needs the quiet wait is
 * possible only once every live participant that is a member of a generation has re-seeded since the last
 * restart (trivially true in the store's first life). A member stalled longer than last_call breaks it.
 *
 * A PAIR THAT CANNOT CONNECT (environment: the link 0-1 is cut at any moment, and may heal). A generation
 * holding both cannot form or goes silent: every member leaves it; each end appends `x0|1` to round g+1
 * (before it joins); the end the rule leaves out on its generation's members (1, the later rank) waits
 * outside until the link heals or its peer is gone, then joins as a newcomer. The rule (in decide):
 * with x0|1 in the round and both ends expected (joined, or live members of P waited for), the one not in
 * P when exactly one is, else 1, is neither a candidate nor waited for (the largest set with no bad pair;
 * ties by rank; join order is approximated by id order). The evidence lives in the store: the side left
 * out posts it again when it re-seeds a restarted store (a requirement the model adds: see below).
 *
 * FAULTS (environment, any moment, each once per scenario): a crash (a participant stops for good,
 * wherever it is: a leader dying mid-round, a member mid-re-seed); a stall (a window in which a live
 * participant looks dead to judges, waiters and the monitor: a hung or GIL-stalled worker; it closes at
 * any time, at the latest when a generation forms); the store restart; the cut and the heal. The
 * environment may stop injecting at any moment (the remaining faults never happen). Heartbeats are
 * abstracted into these views: a crashed participant looks dead, a live one alive but for the stall.
 * Ticks, holes in the event numbering, announce (~p), leave (-p), finish and `fit` are not modelled.
 *
 * CHECKED (assertions, every interleaving):
 *   - one membership per generation, agreed by every member: when p starts generation n, every live
 *     participant whose last generation is n has the same list (whatever store life told it); d/<n> is
 *     written once per store life (compare_set);
 *   - every member of a decision joined its round before it (its +p was in the log);
 *   - a participant trains only in a generation that contains it (a straggler never trains in a round
 *     that excluded it), and its generations strictly increase;
 *   - no split brain, across a store restart: when p starts a generation, any other generation (another
 *     number or another list) training then is broken or pending, or p's is (one of them ends at its next
 *     check): a newcomer on the empty store never trains while the old generation trains unaware;
 *   - no decision holds a pair reported in its round (x0|1);
 *   - rounds stay below R (more would be a livelock: the fault budget costs a bounded number of rounds);
 *   - at the end (nothing can move: SPIN's timeout), every live participant trains in the latest
 *     generation, unbroken and not pending, whose members are exactly the live participants, but for the
 *     side left out while the cut pair is live, which waits outside, and spares when max_workers is full.
 *
 * WHAT THE CODE HAS, WHAT IT LACKS. Two protections found by this model are in rendezvous.py (72543de):
 *   - the leader's poll and the waiter's wake read `next` (current?, obsolete?, over?): a round below it
 *     that is not decided is obsolete. -DNO_HOLE_FIX drops it: (a) a join restarted by the store restart
 *     starts at its own generation + 1 with its own generation as the previous one; when that round was
 *     decided in the old store but all its members went on, nobody re-seeds it, and the joiner waits
 *     there for members that train a later generation and wait for it (until join_timeout); (b) an orphan
 *     round's leader that the guard sends on leaves its waiters behind, waiting for a leader alive and gone;
 *   - an orphan round waits for the re-seed even with max_workers joined. -DAS_CODED -DFULL_SHORTCUT drops
 *     it: spares on the empty store close round 0 at once, pass the guard before the members raise next,
 *     and train generation 0 beside the old generation for good.
 * Three more were found by this model and are in the code since c02c178; -DAS_CODED removes all three
 * (the code as it was at 72543de):
 *   - THE SETTLE FIX (-DNO_SETTLE_FIX): every judgement in a restarted store waits for the members'
 *     re-seed (the quiet wait, counted from the moment the participant learnt of the store's new life),
 *     not only an orphan round's. Without it a generation decided in the old store is decided again, with
 *     other members, by participants whose previous generation is their own (no quiet wait). The restart
 *     alone does it: generation 0 = {0,1} trains; newcomer 2 leads round 1, commits d/1 = {0,1,2}, raises
 *     next, trains generation 1; 0 and 1 wait and have not read d/1 yet; the store restarts; 1 re-seeds
 *     d/0 = {0,1}, its join starts again at round 1 (d/1 is gone: 2 has not re-seeded yet) with its own
 *     {0,1} as the previous generation, and leads it; 0 joins it; both previous members joined, so 1
 *     commits d/1 = {0,1} at once: 0 and 1 train generation 1 = {0,1} while 2 trains generation 1 =
 *     {0,1,2} (AGREE fails). 2's re-seed then finds another list (stale) and ends, but meanwhile two
 *     groups of generation 1, of different sizes, form on the same prefix pg/1 of the same store.
 *   - THE RE-POST (-DNO_REPOST): the side left out posts its x0|1 again when it re-seeds a restarted
 *     store. Without it the evidence dies with the store, and the round in the new store waits for the
 *     side left out (alive, beating, not joined), which waits outside for the link: until join_timeout.
 *   - WAITING OUTSIDE ON THE PEER ITSELF (-DOUTSIDE_STALE): links.py's Links.wait judges the peer gone by
 *     rdzv.alive(), i.e. the summary s/<g> of its own generation g, which g's monitor (rank 0) writes only
 *     while g is its generation. When the monitor is the other end (0), it goes on to g+1, s/<g> stops
 *     changing, the side left out finds it gone after `expiry` and rejoins as a newcomer; generation g+2
 *     takes both again, fails its link check, leaves it out again, ...: a livelock (rounds run out). The
 *     model's side left out waits until the link heals or the peer is really gone (crashed, or a stall).
 *
 * SCENARIOS (init picks one; the default run explores their union; -DSCENARIO=k one of them):
 *   0 {0,1,2}: the pair cut and healed, the store            270,478 states
 *   1 {0,1,2}: the pair cut for good, a crash, the store     234,960
 *   2 {0,1,2}: a stall, the store                            568,420
 *   3 {0,1,2}: a crash and a stall                           226,238
 *   4 {0,1} at generation 2, a newcomer: a crash, the store  563,648
 *   5 {0} at generation 2, two newcomers: the store          544,816
 *   6 {0} at 2, max_workers 1, two spares: a crash, store     16,012
 *   7 everything at once: not in the default run, and not verified (all the faults together need
 *     R >= 11 rounds; at -DR=9 a hash-compacted search (-DHC4) passed 91 M states before they ran out)
 * The union is smaller than the sum: states that become identical once the faults are spent are shared.
 *
 * Run (tests/recovery/test_rendezvous.py runs it when spin and gcc exist):
 *   spin -a rendezvous.pml && gcc -O2 -DSAFETY -DNOREDUCE -o pan pan.c && ./pan -m100000 -w22
 * 1,351,771 states, 0 errors, about 2 s and 200 MB here (gcc about 6 s); 2,260,786 before members joined
 * their next round at once (no hint, no scan).
 *
 * MUTATIONS (each makes pan fail; spin -D<flag> -a ...):
 *   -DAS_CODED                     fails (the first error pan finds: rounds run out, -DOUTSIDE_STALE's)
 *   -DNO_SETTLE_FIX                one membership per generation (AGREE) fails: the trace above
 *   -DNO_HOLE_FIX                  convergence fails (-DSCENARIO=2: the hole; -DSCENARIO=5: a waiter left
 *                                  behind by its leader)
 *   -DAS_CODED -DFULL_SHORTCUT     with -DSCENARIO=6: split brain (SB) fails (spares on the empty store)
 *   -DNO_ORPHAN_WAIT               an orphan round judged at once: split brain (SB) fails
 *   -DNO_GUARD                     harmless while the poll reads next; with -DNO_HOLE_FIX -DSCENARIO=4:
 *                                  split brain (SB) fails (it passes without -DNO_GUARD)
 *   -DNO_PAIR_RULE                 a decision with a reported pair
 *   -DNO_REPOST                    convergence fails (the evidence lost in the restart)
 *   -DOUTSIDE_STALE                rounds run out (the livelock)
 */

#ifndef R
#define R 8            /* rounds 0..R-1; reaching R is an error (enlarge R, or a livelock) */
#endif
#ifdef AS_CODED        /* rendezvous.py and links.py as they were at 72543de: see the header */
#define NO_SETTLE_FIX
#define NO_REPOST
#define OUTSIDE_STALE
#endif

#define N 3
#define ALL 7
#define BIT(i) (1 << (i))
#define POP(x) (((x) & 1) + (((x) >> 1) & 1) + (((x) >> 2) & 1))

/* phases */
#define TRAIN 1
#define FIN 2          /* fin + hint: round = max(round, next); a member of generation n-1: straight to JOIN */
#define SCAN 3         /* skip decided rounds */
#define JOIN 4         /* slot + put: +me; the previous generation when it is this participant's own */
#define PREV 5         /* prev + prevall: d/<n-1> and its members (none: an orphan round) */
#define LEAD 6         /* compare_set lead/<n> */
#define POLL 7         /* the leader: poll + count + read + judge (waits while the judgement is "not yet") */
#define GUARD 8        /* orphan rounds: does next still allow this round? */
#define COMMIT 9       /* compare_set d/<n> (propose, m/<n>/<me>, was written with the judgement) */
#define WAIT 10        /* a waiter: wait + wake + sleep, until d/<n> or its leader looks gone */
#define TAKEOVER 11    /* compare_set lead/<n> from the leader it waited for */
#define HINTED 12      /* the committer raises next to n+1, then trains */
#define EVID 13        /* an end of the cut pair appends x0|1 to round g+1 */
#define OUTSIDE 14     /* the side the rule leaves out waits outside: the link heals, or its peer is gone */

/* ---- the store (one life; emptied by a restart) */
byte dec[R + 1];       /* d/<n>: the decision's members (0: none) */
byte joined[R + 1];    /* r/<n>: who appended +p */
byte lead[R + 1];      /* lead/<n>: leader + 1 (0: none) */
short ev;              /* bit n: x0|1 in r/<n> */
byte nxt;              /* next */
byte life;             /* epoch: the store's life */

/* ---- the participants */
byte ph[N];
byte rnd[N];           /* the round it is joining */
byte g1[N];            /* its generation + 1 (0: never a member) */
byte mem[N];           /* ... and that generation's members */
byte rof[N];           /* the round it last appended to (or its generation): a member that went on */
byte prv[N];           /* the previous generation of its round, as it read it */
bool orph[N];          /* its round is an orphan (no previous generation in the store) */
byte ldr[N];           /* the leader it waits for */
byte prop[N];          /* its proposal */
byte conn[N];          /* the store life its connection belongs to */
bool rsb[N];           /* re-seed half done: next not raised yet */
bool stale[N];         /* its generation was re-decided without it in this store life */

/* ---- the world */
byte crashed;
byte wrong;            /* a live participant that looks dead (to judges, waiters, monitors) */
bool cut;
byte crashes, wrongs, restarts, cuts, heals;   /* fault budgets (the scenario's) */
byte maxw;              /* max_workers (min_workers = first_workers = 1) */
bool env_done;

#define ALIVE(i) (((crashed >> (i)) & 1) == 0)
#define READY (conn[me] == life && !rsb[me])
#define EV(n) ((ev >> (n)) & 1)

/* generation of q broken: a member crashed or went on to a later round, or the cut pair is in it */
#define BR(q, i) ((i) != (q) && ((mem[q] >> (i)) & 1) && (!ALIVE(i) || rof[i] >= g1[q]))
#define BROKEN(q) (BR(q, 0) || BR(q, 1) || BR(q, 2) || (cut && (mem[q] & 3) == 3))
/* pending() of q in this store: round g+1 decided, joined (a newcomer: if there is room), evidence,
   a member that looks dead to the monitor, or the generation re-decided without q */
#define ROOM(q) ((POP(mem[q]) < maxw) -> ALL : mem[q])
#define PEND(q) (dec[g1[q]] != 0 || (joined[g1[q]] & ROOM(q)) != 0 || EV(g1[q]) || \
                 (wrong & mem[q] & ~BIT(q)) != 0 || stale[q])
#define DOOMED(q) (BROKEN(q) || PEND(q))

/* ---- the timing assumption: a quiet wait (last_call, 1 s) ends only after every live member of a
   generation re-seeded the restarted store (within a few heartbeat periods). Since the store's start,
   before any restart, it holds trivially. As coded, only a round with no previous member among its
   candidates (and fewer than max_workers) waits; with FIX 2, every judgement in a restarted store. */
#define RSOK(i) (!ALIVE(i) || g1[i] == 0 || (conn[i] == life && !rsb[i]))
#define QUIET0 (RSOK(0) && RSOK(1) && RSOK(2))
#ifdef NO_ORPHAN_WAIT  /* mutation: an orphan round does not wait (its leader may judge at once) */
#define QUIET (QUIET0 || orph[me])
#else
#define QUIET QUIET0
#endif

/* ---- decide(), for the leader `me` of round rnd[me]: P its previous generation, J the joiners it read,
   V who looks dead. Joiners are alive; the candidates are the joiners; the live members of P that have
   not joined are waited for. The largest-set rule: with x0|1 in the round and both ends expected (joined,
   or waited for), one end is left out: the one not in P when exactly one is, else 1 (the later rank). */
#define P prv[me]
#define J joined[rnd[me]]
#define V (crashed | wrong)
#define XP (J | (P & ~J & ~V))
#ifdef NO_PAIR_RULE
#define DROP 0
#else
#define DROP ((EV(rnd[me]) && (XP & 3) == 3) -> (((P & 3) == 2) -> 1 : 2) : 0)
#endif
#define CAND (J & ~DROP)
#define MISS (P & ~J & ~V & ~DROP)
#define WAITM (MISS != 0 && POP(CAND & P) < maxw)
#define FULL (POP(CAND) >= maxw)
#ifndef NO_SETTLE_FIX  /* the settle fix: every judgement in a restarted store waits for its re-seed */
#define PROPOSE_OK (!WAITM && CAND != 0 && QUIET)
#else                  /* as coded: an orphan round waits (_proposer, even with max_workers joined, unless
                          -DFULL_SHORTCUT: decide() alone, before 72543de); another round waits only when
                          no previous member is among the candidates and fewer than max_workers joined */
#ifdef FULL_SHORTCUT
#define ORPHAN_OK (FULL || QUIET)
#else
#define ORPHAN_OK QUIET
#endif
#define PROPOSE_OK (!WAITM && CAND != 0 && (orph[me] -> ORPHAN_OK : (FULL || (CAND & P) != 0 || QUIET)))
#endif

/* the first maxw of the candidates, previous members first */
inline choose() {
  prop[me] = CAND;
  if
  :: POP(prop[me]) > maxw ->
     byte pick = 0, k = 0;
     do
     :: k < N && POP(pick) < maxw && ((prop[me] & P) >> k) & 1 -> pick = pick | BIT(k); k++
     :: k < N && !(POP(pick) < maxw && ((prop[me] & P) >> k) & 1) -> k++
     :: k == N -> break
     od;
     k = 0;
     do
     :: k < N && POP(pick) < maxw && ((prop[me] & ~P) >> k) & 1 -> pick = pick | BIT(k); k++
     :: k < N && !(POP(pick) < maxw && ((prop[me] & ~P) >> k) & 1) -> k++
     :: k == N -> break
     od;
     prop[me] = pick; pick = 0; k = 0
  :: else -> skip
  fi
}

/* no split brain, against participant q: when another generation (another number, or another list)
   trains, one of the two ends at its next check (broken or pending) */
#define SB(q) assert(q == me || !(ph[q] == TRAIN && ALIVE(q) && (g1[q] != g1[me] || mem[q] != mem[me])) || \
                     DOOMED(q) || DOOMED(me))

/* one membership per generation, agreed by every member: every live participant whose last generation
   is n has the same list (whatever the store life that told it) */
#define AGREE(q) assert(q == me || !ALIVE(q) || g1[q] != g1[me] || mem[q] == mem[me])

/* me starts training generation n with members d */
inline enter(n, d) {
  assert(n + 1 > g1[me]);                         /* generations strictly increase */
  assert((d >> me) & 1);                          /* never in a generation that excluded it */
  g1[me] = n + 1; mem[me] = d; rof[me] = n; ph[me] = TRAIN; stale[me] = false;
  AGREE(0); AGREE(1); AGREE(2);
  SB(0); SB(1); SB(2);
  wrong = 0                                       /* a stall lasts at most until a generation forms */
}

/* a decision d read (or won) for round rnd[me] */
inline decided(d, won) {
  if
  :: !((d >> me) & 1) -> ph[me] = FIN; rnd[me]++    /* a straggler: a newcomer of the next round */
  :: else ->
     if
     :: won -> prop[me] = d; ph[me] = HINTED
     :: else -> enter(rnd[me], d); prop[me] = 0
     fi
  fi;
  prv[me] = 0; orph[me] = false; ldr[me] = 0
}

/* a round below `next` that is not decided is obsolete: the leader's poll (current?) and the waiter's wake
   (obsolete?) read next too, then over? (72543de); -DNO_HOLE_FIX drops them */
#ifndef NO_HOLE_FIX
#define HOLE (nxt > rnd[me])
#else
#define HOLE 0
#endif

#define JOINING (ph[me] != TRAIN && ph[me] != EVID && ph[me] != OUTSIDE)

proctype participant(byte me) {
end_loop:
  do
  /* the store restarted: the first operation fails, the client reconnects, finds another epoch and
     re-seeds: m/<g>/me and compare_set d/<g> (the stale flag when another list got there first) ... */
  :: atomic { ALIVE(me) && conn[me] != life ->
       conn[me] = life;
       if
       :: g1[me] > 0 ->
          if
          :: dec[g1[me] - 1] == 0 -> dec[g1[me] - 1] = mem[me]
          :: dec[g1[me] - 1] != 0 && dec[g1[me] - 1] != mem[me] -> stale[me] = true
          :: else -> skip
          fi;
#ifndef NO_REPOST
          if                                 /* the side left out posts its evidence again */
          :: ph[me] == OUTSIDE -> ev = ev | (1 << g1[me])
          :: else -> skip
          fi;
#endif
          rsb[me] = true
       :: else ->
          if
          :: JOINING -> ph[me] = FIN; rnd[me] = 0; prv[me] = 0; orph[me] = false; ldr[me] = 0; prop[me] = 0
          :: else -> skip
          fi
       fi }
  /* ... then raises next to g; a join in progress starts again (fin, round g+1) */
  :: atomic { ALIVE(me) && conn[me] == life && rsb[me] ->
       if
       :: nxt < g1[me] - 1 -> nxt = g1[me] - 1
       :: else -> skip
       fi;
       rsb[me] = false;
       if
       :: JOINING -> ph[me] = FIN; rnd[me] = g1[me]; prv[me] = 0; orph[me] = false; ldr[me] = 0; prop[me] = 0
       :: else -> skip
       fi }
  :: atomic { ALIVE(me) && READY && ph[me] == FIN ->
       if
       :: rnd[me] > 0 && g1[me] == rnd[me] -> ph[me] = JOIN  /* a member of generation n-1: round n at once */
       :: else ->
          if
          :: nxt > rnd[me] -> rnd[me] = nxt
          :: else -> skip
          fi;
          assert(rnd[me] < R);
          ph[me] = SCAN
       fi }
  :: atomic { ALIVE(me) && READY && ph[me] == SCAN ->
       if
       :: dec[rnd[me]] != 0 -> rnd[me]++; assert(rnd[me] < R)
       :: else -> ph[me] = JOIN
       fi }
  :: atomic { ALIVE(me) && READY && ph[me] == JOIN ->
       joined[rnd[me]] = joined[rnd[me]] | BIT(me);
       rof[me] = rnd[me];
       if
       :: rnd[me] == 0 -> prv[me] = 0; orph[me] = true; ph[me] = LEAD
       :: rnd[me] > 0 && g1[me] == rnd[me] -> prv[me] = mem[me]; orph[me] = false; ph[me] = LEAD
       :: else -> ph[me] = PREV
       fi }
  :: atomic { ALIVE(me) && READY && ph[me] == PREV ->
       prv[me] = dec[rnd[me] - 1];
       orph[me] = (prv[me] == 0);
       ph[me] = LEAD }
  :: atomic { ALIVE(me) && READY && ph[me] == LEAD ->
       if
       :: lead[rnd[me]] == 0 -> lead[rnd[me]] = me + 1
       :: else -> skip
       fi;
       if
       :: lead[rnd[me]] == me + 1 -> ph[me] = POLL
       :: else -> ldr[me] = lead[rnd[me]] - 1; ph[me] = WAIT
       fi }
  :: atomic { ALIVE(me) && READY && ph[me] == POLL && (dec[rnd[me]] != 0 || HOLE || PROPOSE_OK) ->
       if
       :: dec[rnd[me]] != 0 -> decided(dec[rnd[me]], false)
       :: dec[rnd[me]] == 0 && HOLE -> ph[me] = FIN; rnd[me]++; prv[me] = 0; orph[me] = false
       :: else ->
          choose();
          if
          :: orph[me] -> ph[me] = GUARD
          :: else -> ph[me] = COMMIT
          fi
       fi }
  :: atomic { ALIVE(me) && READY && ph[me] == GUARD ->
#ifndef NO_GUARD
       if
       :: nxt > rnd[me] -> ph[me] = FIN; rnd[me]++; prv[me] = 0; orph[me] = false; prop[me] = 0
       :: else -> ph[me] = COMMIT
       fi
#else
       ph[me] = COMMIT
#endif
     }
  :: atomic { ALIVE(me) && READY && ph[me] == COMMIT ->
       if
       :: dec[rnd[me]] == 0 ->
          assert((prop[me] & ~joined[rnd[me]]) == 0);              /* every member joined its round */
          assert(!(EV(rnd[me]) && (prop[me] & 3) == 3));           /* no decision with a reported pair */
          dec[rnd[me]] = prop[me];
          decided(prop[me], true)
       :: else -> decided(dec[rnd[me]], false)
       fi }
  :: atomic { ALIVE(me) && READY && ph[me] == WAIT &&
              (dec[rnd[me]] != 0 || HOLE || !ALIVE(ldr[me]) || ((wrong >> ldr[me]) & 1)) ->
       if
       :: dec[rnd[me]] != 0 -> decided(dec[rnd[me]], false)
       :: dec[rnd[me]] == 0 && HOLE -> ph[me] = FIN; rnd[me]++; prv[me] = 0; orph[me] = false; ldr[me] = 0
       :: else -> ph[me] = TAKEOVER
       fi }
  :: atomic { ALIVE(me) && READY && ph[me] == TAKEOVER ->
       if
       :: lead[rnd[me]] == ldr[me] + 1 -> lead[rnd[me]] = me + 1; ph[me] = POLL
       :: else -> ldr[me] = lead[rnd[me]] - 1; ph[me] = WAIT
       fi }
  :: atomic { ALIVE(me) && READY && ph[me] == HINTED ->
       if
       :: nxt < rnd[me] + 1 -> nxt = rnd[me] + 1
       :: else -> skip
       fi;
       enter(rnd[me], prop[me]); prop[me] = 0 }
  /* training: ends when the generation is broken (a collective or the link check fails: no store
     needed) or pending() (the heartbeat thread, through the store) */
  :: atomic { ALIVE(me) && ph[me] == TRAIN && (BROKEN(me) || (READY && PEND(me))) ->
       if
       :: cut && (mem[me] & 3) == 3 && me < 2 -> ph[me] = EVID
       :: else -> ph[me] = FIN; rnd[me] = g1[me]
       fi }
  :: atomic { ALIVE(me) && READY && ph[me] == EVID ->
       ev = ev | (1 << g1[me]);
       rof[me] = g1[me];
       if
       :: me == 1 -> ph[me] = OUTSIDE     /* the rule on its generation's members leaves it out */
       :: else -> ph[me] = FIN; rnd[me] = g1[me]
       fi }
  :: atomic { ALIVE(me) && ph[me] == OUTSIDE &&
#ifdef OUTSIDE_STALE     /* Links.wait's rdzv.alive(): s/<g> goes stale once the monitor (0) moved on */
              (!cut || !ALIVE(0) || ((wrong >> 0) & 1) || g1[0] > g1[me]) ->
#else
              (!cut || !ALIVE(0) || ((wrong >> 0) & 1)) ->
#endif
       ph[me] = FIN; rnd[me] = g1[me] }
  od
}

/* faults, each at any moment; the environment may also stop injecting them (the rest never happen) */
active proctype environment() {
  do
  :: atomic { restarts > 0 ->
       restarts--; life++;
       byte k = 0;
       do
       :: k <= R -> dec[k] = 0; joined[k] = 0; lead[k] = 0; k++
       :: else -> break
       od;
       k = 0; ev = 0; nxt = 0 }
  :: atomic { crashes > 0 ->
       if
       :: ALIVE(0) -> crashed = crashed | 1
       :: ALIVE(1) -> crashed = crashed | 2
       :: ALIVE(2) -> crashed = crashed | 4
       fi;
       crashes-- }
  :: atomic { wrongs > 0 && wrong == 0 ->
       if
       :: ALIVE(0) -> wrong = 1
       :: ALIVE(1) -> wrong = 2
       :: ALIVE(2) -> wrong = 4
       fi;
       wrongs-- }
  :: wrong != 0 -> wrong = 0
  :: atomic { cuts > 0 -> cuts--; cut = true }
  :: atomic { cut && heals > 0 -> heals--; cut = false }
  :: atomic { wrong = 0; env_done = true; break }
  od;
  /* nothing can move: every live participant trains in the latest generation, whose members are exactly
     the live participants, but for the side left out while the cut pair is live, which waits outside */
  timeout ->
  atomic {
    byte latest = 0, out = 0, i = 0;
    if
    :: cut && ALIVE(0) && ALIVE(1) -> out = 2
    :: else -> skip
    fi;
    do
    :: i < N -> if :: ALIVE(i) && ph[i] == TRAIN && g1[i] > latest -> latest = g1[i] :: else -> skip fi; i++
    :: else -> break
    od;
    i = 0;
    do
    :: i < N ->
       if
       :: !ALIVE(i) -> skip
       :: ALIVE(i) && (out >> i) & 1 -> assert(ph[i] == OUTSIDE)
       :: else ->
          if
          :: ph[i] == TRAIN ->
             assert(g1[i] == latest && !BROKEN(i) && !PEND(i));
             assert(mem[i] == (ALL & ~crashed & ~out) ||
                    (POP(mem[i]) == maxw && (mem[i] & ~(ALL & ~crashed & ~out)) == 0))
          :: else ->  /* a spare (the latest generation is full): waits in the next round */
             assert(POP(ALL & ~crashed & ~out) > maxw && (ph[i] == POLL || ph[i] == WAIT) && rnd[i] == latest)
          fi
       fi;
       i++
    :: else -> break
    od
  }
}

/* scenario k: generation `gen` = `init_members` trains, the others are newcomers; the fault budgets */
inline setup(init_members, gen, mw, cr, wr, rs, ct, hl) {
  maxw = mw; crashes = cr; wrongs = wr; restarts = rs; cuts = ct; heals = hl;
  dec[gen] = init_members; joined[gen] = init_members; nxt = gen + 1; lead[gen] = 1;
  i = 0;
  do
  :: i < N ->
     if
     :: (init_members >> i) & 1 -> ph[i] = TRAIN; g1[i] = gen + 1; mem[i] = init_members; rof[i] = gen
     :: else -> ph[i] = FIN
     fi;
     i++
  :: else -> break
  od;
  i = 0
}

#ifndef SCENARIO
#define SCENARIO 99    /* every scenario but the last */
#endif
#define PICK(k) (SCENARIO == 99 && k < 7 || SCENARIO == k)

init {
  atomic {
    byte i;
    if           /*   members gen max crash stall store cut heal */
    :: PICK(0) -> setup(7,      0,  3,  0,    0,    1,    1,  1)  /* the pair cut and healed, the store */
    :: PICK(1) -> setup(7,      0,  3,  1,    0,    1,    1,  0)  /* the pair cut for good, a crash, store */
    :: PICK(2) -> setup(7,      0,  3,  0,    1,    1,    0,  0)  /* a stall, the store */
    :: PICK(3) -> setup(7,      0,  3,  1,    1,    0,    0,  0)  /* a crash and a stall */
    :: PICK(4) -> setup(3,      2,  3,  1,    0,    1,    0,  0)  /* a newcomer; a crash, the store */
    :: PICK(5) -> setup(1,      2,  3,  0,    0,    1,    0,  0)  /* two newcomers; the store */
    :: PICK(6) -> setup(1,      2,  1,  1,    0,    1,    0,  0)  /* full (max 1), two spares; crash, store */
    :: PICK(7) -> setup(7,      0,  3,  1,    1,    1,    1,  1)  /* everything (-DSCENARIO=7 -DR=12) */
    fi;
    run participant(0);
    run participant(1);
    run participant(2)
  }
}

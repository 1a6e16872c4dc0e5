/*
 * The round protocol of elastic.run (docs/rendezvous.md), as a SPIN model.
 *
 * N participants, members of generation 0. Each trains until its generation is broken (a member
 * crashed or went on) or pending() says so, then joins the next round: it appends itself to the
 * round's log, reads the previous generation, and polls; a poll that sees no decision may propose the
 * joined participants it believes alive once every previous member it believes alive has joined. The
 * first proposal appended is the decision (modelled as a write to an empty slot, atomically, as the
 * store orders appends). A participant not in the decision is a straggler: it joins the next round.
 * Faults: CRASHES crashes anywhere, SUSPECT wrong judgements of a live participant as dead (a hung or
 * GIL-stalled worker whose heartbeat looks expired).
 *
 * Checked (assertions, every interleaving):
 *   - one decision per round, made once, never changed (won[r] <= 1);
 *   - every member of a decision had joined its round before it was made;
 *   - a participant trains only in a generation whose decision contains it (a straggler never forms a
 *     second group), and its generations strictly increase;
 *   - at the end (nothing can move, the `timeout` of SPIN), every live participant trains in the latest
 *     generation and that generation is exactly the live participants: the protocol converged.
 *
 * Run: spin -a rendezvous.pml && gcc -O2 -DSAFETY -o pan pan.c && ./pan -m100000
 */

#define N 3
#define R 6            /* rounds 0..R-1 (generation 0 is given) */
#define CRASHES 1
#define SUSPECT 1
#define ALL ((1 << N) - 1)

byte dec[R];           /* decision of round r: a bit mask of members; 0: undecided */
byte joined[R];        /* who appended +p to round r */
byte joined_at_dec[R]; /* joined[r] when dec[r] was made */
byte won[R];           /* proposals that became the decision (must stay <= 1) */
byte crashed;          /* bit mask */
byte round_of[N];      /* the round a participant is joining, or its generation while training */
bool training[N];
byte gen[N];           /* last generation it trained in */
byte crashes = CRASHES;
byte suspicions = SUSPECT;
byte stopped_count;             /* participants that stopped (crashed or quiescent) */

inline crash_point() {
  if
  :: atomic { crashes > 0 -> crashes--; crashed = crashed | (1 << me); training[me] = false; stopped_count++ };
     goto stopped
  :: skip
  fi
}

/* is the current generation of `me` broken: a member crashed or is already in a later round */
inline is_broken(g, result) {
  result = false;
  i = 0;
  do
  :: i < N ->
     if
     :: (dec[g] & (1 << i)) && i != me && ((crashed & (1 << i)) || round_of[i] > g) -> result = true
     :: else -> skip
     fi;
     i++
  :: else -> break
  od
}

proctype participant(byte me) {
  byte r, prev, alive, cand, missing, d, i, victim, snap;
  bool brk;

  gen[me] = 0; round_of[me] = 0; training[me] = true;
train:
  crash_point();
  /* train until broken or pending; at the end of everything (timeout) stop here */
  do
  :: atomic {
       is_broken(gen[me], brk);
       if
       :: brk || (gen[me] + 1 < R && (dec[gen[me] + 1] != 0 || (joined[gen[me] + 1] & ~(1 << me)) != 0)) ->
          training[me] = false; r = gen[me] + 1; break
       :: else -> skip
       fi
     }
  :: timeout -> goto quiescent
  od;
join:
  crash_point();
  if
  :: r >= R -> goto out_of_rounds
  :: else -> skip
  fi;
  if
  :: dec[r] != 0 -> r++; goto join        /* scan: a decided round is skipped */
  :: else -> skip
  fi;
  round_of[me] = r;
  joined[r] = joined[r] | (1 << me);      /* append +me */
  crash_point();
  prev = dec[r - 1];                      /* the previous generation */
poll:
  crash_point();
  atomic { snap = joined[r]; d = dec[r] }   /* ONE read of the round's log */
  if
  :: d != 0 -> goto decided
  :: else -> skip
  fi;
  /* this proposer's view of the heartbeats: the crashed are dead, maybe one live other too */
  alive = ALL & ~crashed;
  if
  :: atomic { suspicions > 0 -> suspicions--;
       if
       :: victim = 0
       :: victim = 1
       :: victim = 2
       fi;
       if
       :: victim != me -> alive = alive & ~(1 << victim)
       :: else -> skip
       fi }
  :: skip
  fi;
  cand = snap & alive;
  missing = prev & alive & ~snap;
  if
  :: missing == 0 && cand != 0 ->
     crash_point();
     atomic {                              /* append a proposal: the first one is the decision */
       if
       :: dec[r] == 0 -> dec[r] = cand; joined_at_dec[r] = joined[r]; won[r]++; assert(won[r] <= 1)
       :: else -> skip
       fi
     }
  :: else -> skip                          /* wait for the missing, poll again */
  fi;
  goto poll;
decided:
  d = dec[r];
  assert((d & ~joined_at_dec[r]) == 0);   /* every member joined before the decision */
  if
  :: d & (1 << me) ->
     assert(r > gen[me]);                  /* generations strictly increase */
     gen[me] = r; round_of[me] = r; training[me] = true;
     goto train
  :: else ->
     r++; goto join                        /* a straggler is a newcomer of the next round */
  fi;
quiescent:
  /* nothing can move: every live participant trains in the latest generation, which is exactly them */
  i = R - 1;
  do
  :: dec[i] == 0 && i > 0 -> i--
  :: else -> break
  od;
  assert(gen[me] == i && dec[i] == (ALL & ~crashed) && training[me]);
  goto stopped;
out_of_rounds:
  assert(false);                            /* R too small for the faults: enlarge R */
stopped:
  skip
}

init {
  dec[0] = ALL;
  joined[0] = ALL;
  joined_at_dec[0] = ALL;
  atomic {
    run participant(0);
    run participant(1);
    run participant(2)
  }
}

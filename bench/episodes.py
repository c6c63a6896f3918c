"""Episodes per second, continuous against waves, with an environment whose step takes 0 to 2 s.

    python bench/episodes.py [--episodes 32] [--concurrent 16] [--delay 2.0] [--repeats 2]

Both schedules play the same episodes (same reset seeds, same turn seeds) of the bundled guess-number
game, served with `--step-delay`, on tiny-random-llama (sampling takes milliseconds: the environment is
the cost, as with a slow tool or a remote sandbox). Waves wait, turn by turn, for their slowest
episode; continuous episodes go on as soon as their own observation arrives. Each schedule runs
`--repeats` times, alternating; the episodes and tokens are checked to be the same.
Ends with: RESULT waves_eps=... continuous_eps=... speedup=...
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from service.core.specs import LoraSpec, ModelSpec
from worker.batch import SamplingParams
from worker.engines.hf_engine import HFEngine, eos_token_ids
from worker.environments.continuous import Continuous
from worker.environments.runner import EpisodeScheduler, Limits, Players, Waves, play
from worker.environments.servers import BundledServer
from worker.environments.turns import PlainTurns
from worker.model.loading import load_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=32, help="episodes per run (groups of 4)")
    ap.add_argument("--concurrent", type=int, default=16, help="environment.max_concurrent")
    ap.add_argument("--delay", type=float, default=2.0, help="each step takes a random 0 to this many seconds")
    ap.add_argument("--turns", type=int, default=4, help="environment.max_turns")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model, tok = load_policy(ModelSpec(name="tiny-random-llama", lora=LoraSpec(r=4)), models_root=tmp, device="cpu",
                             seed=0)
    engine = HFEngine(model, tok, "cpu", SamplingParams(max_new_tokens=8, temperature=1.0))
    players = Players(engine=engine, tokenizer=tok, turns=PlainTurns(tok), eos_ids=frozenset(eos_token_ids(tok, model)),
                      max_new_tokens=8)
    limits = Limits(max_turns=args.turns, max_episode_tokens=200, max_observation_tokens=48,
                    max_concurrent=args.concurrent, timeout_s=30.0, max_bytes=1 << 20)
    server = BundledServer("guess-number", tmp / "guess.log", step_delay_s=args.delay)
    url = server.start()
    seeds = list(range(args.episodes // 4))
    schedules: dict[str, EpisodeScheduler] = {"waves": Waves(), "continuous": Continuous()}
    rates: dict[str, list[float]] = {name: [] for name in schedules}
    played = {}
    try:
        for _ in range(args.repeats):
            for name, scheduler in schedules.items():
                t0 = time.perf_counter()
                episodes, _ = play(players, url, seeds, 4, limits, seed_of=lambda i, turn: 1000 * i + turn,
                                   scheduler=scheduler)
                rates[name].append(len(episodes) / (time.perf_counter() - t0))
                played[name] = [(e.ids, [t.observation for t in e.turns]) for e in episodes]
                assert all(e.error is None for e in episodes), [e.error for e in episodes if e.error]
    finally:
        server.stop()
    same = played["waves"] == played["continuous"]
    for name, r in rates.items():
        print(f"{name:>10}: {statistics.median(r):.2f} episodes/s (runs: {', '.join(f'{x:.2f}' for x in r)})")
    w, c = statistics.median(rates["waves"]), statistics.median(rates["continuous"])
    print(f"same episodes and tokens: {same}")
    print(f"RESULT waves_eps={w:.3f} continuous_eps={c:.3f} speedup={c / w:.2f} same_tokens={same}")


if __name__ == "__main__":
    main()

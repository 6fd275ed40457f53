"""The application config of the Serve layer, and the pure function that turns it into deployment options.

pydantic lives here (an edge): every field has a description and bad values fail with a clear message.
`deployment_options(config)` is the one place resources, placement bundles and Serve options are computed;
it is pure (no Ray, no I/O) and unit-tested.

Resource layout of a model deployment (drafter or target), after Ray Serve LLM:
- the Serve replica is a light *host* actor that owns one *worker* actor per model shard;
- the worker holds the model and the KV-cache slot table, and is what the coordinator calls directly
  (a plain actor call: 0.8 ms here, against 2.5 ms for a Serve handle call);
- with accelerators, the replica gets a placement group of `tensor_parallel_size` bundles, one per
  worker rank, packed on one node (STRICT_PACK); the host actor's own resources are merged into bundle 0
  so that it sits with rank 0. Worker rank i is scheduled into bundle i.
- on CPU with one shard no placement group is used (Ray refuses bundles without resources).
"""

from __future__ import annotations

import os
from typing import Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    SerializationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from pipeline import envs
from pipeline.config import (
    HYBRID_PREFIX,
    NO_DRAFT,
    PROMPT_LOOKUP,
    SUFFIX,
    TreeConfig,
    draft_model_spec,
    is_head,
    is_self,
    is_synthetic,
    parse_synthetic,
)

# Deployment names: fixed, so the coordinator, tests and ops tooling can find replicas and workers.
INGRESS = "Ingress"
COORDINATOR = "Coordinator"
DRAFTER = "Drafter"
TARGET = "Target"
EMBEDDED_REDIS = "EmbeddedRedis"
PRESPEC_BRANCHES = 4  # coordinator.prespec_branches' default (docs/configuration.md says how it was chosen)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class Resources(_Strict):
    """What one replica of a model deployment needs, per worker (tensor-parallel rank)."""

    num_replicas: int = Field(1, ge=1, description="Serve replicas of this deployment.")
    num_cpus: float = Field(
        0.0, ge=0, description="CPUs per worker. 0 on small CPU machines: Ray would otherwise refuse to place "
        "a third replica on 2 cores and leave the app DEPLOYING forever."
    )
    num_gpus: float = Field(0.0, ge=0, description="GPUs per worker (0: CPU).")
    accelerator_type: Optional[str] = Field(
        None, description="Ray accelerator type the workers need, e.g. 'L4', 'T4', 'A10G', 'H100'."
    )
    memory_gb: Optional[float] = Field(None, gt=0, description="Host memory reserved per worker.")
    torch_threads: int = Field(1, ge=1, description="torch.set_num_threads in each worker process.")

    @model_validator(mode="after")
    def _accelerator_needs_gpu(self) -> "Resources":
        if self.accelerator_type and self.num_gpus <= 0:
            raise ValueError(f"accelerator_type={self.accelerator_type!r} needs num_gpus > 0")
        return self


class TargetConfig(_Strict):
    model: Optional[str] = Field(None, description="Target model folder; None: the demo target (SmolLM2-135M).")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs (workers) per replica, on one node.")
    resources: Resources = Field(default_factory=Resources)
    max_batch_size: int = Field(
        16, ge=1, description="Most KV-cache slots (requests one replica holds at once, rows of a pass); the "
        "memory budget may allow fewer (kv_cache_gb).")
    max_seq_len: int = Field(2048, ge=8, description="Prompt + generated tokens per request.")
    kv_cache_gb: Optional[float] = Field(
        None, gt=0, description="KV-cache memory per worker (rank), GiB; slots = what it holds of max_seq_len "
        "positions each, at most max_batch_size (deployments.admission.kv_cache_slots). None: on CUDA "
        "kv_cache_fraction of the device memory free after loading the model, on CPU max_batch_size slots.")
    kv_cache_fraction: float = Field(
        0.9, gt=0, le=1, description="Share of the free device memory the KV cache may take when kv_cache_gb is None "
        "(CUDA only).")
    max_waiting: int = Field(
        64, ge=0, description="Requests one replica queues for a free KV-cache slot; a request that finds every "
        "replica's queue full gets HTTP 429 with Retry-After.")
    batch_wait_ms: float = Field(
        1.0, ge=0, le=50,
        description="Longest wait for other requests' verify calls to join a target pass. Only waited for "
        "while requests known to be active on this replica have not sent their call yet.",
    )
    device: str = Field("cpu", description="torch device of the workers ('cpu', 'cuda').")
    dtype: str = Field("float32", description="'float32' | 'bfloat16' | 'float16'.")
    tp_allreduce: Literal["auto", "fused", "symm", "nccl"] = Field(
        "auto",
        description="Tensor parallel on CUDA: how a step sums the ranks' partial results. 'auto': 'fused' (the "
        "fused layer's linears send their partials to every rank) at 2 and 4 ranks, else 'symm' (a symmetric-memory "
        "all-reduce kernel), else 'nccl' (pipeline.models.tensor_parallel). CPU groups use gloo.",
    )

    @model_validator(mode="after")
    def _allreduce_needs_cuda_group(self) -> "TargetConfig":
        if self.tp_allreduce != "auto" and (self.tensor_parallel_size < 2 or not self.device.startswith("cuda")):
            raise ValueError(f"tp_allreduce={self.tp_allreduce!r} applies to tensor-parallel CUDA targets "
                             f"(tensor_parallel_size={self.tensor_parallel_size}, device={self.device!r})")
        return self


class TreeSpec(_Strict):
    """A token tree for the feature head in the target worker: `pipeline.config.TreeConfig`'s fields."""

    branching: list[int] = Field(default_factory=list, description="Children per node at each depth (the tree's "
                                 "depth is its length); with `dynamic`, nodes kept to grow on and children each, per "
                                 "depth. Left out with `paths`.")
    max_nodes: Optional[int] = Field(None, ge=1, description="Node budget; None: the full tree.")
    dynamic: bool = Field(False, description="EAGLE-2's dynamic tree (an EAGLE-3 head, greedy requests; sampled "
                          "requests draft the static shape). Needs max_nodes.")
    paths: Optional[list[list[int]]] = Field(None, description="An explicit shape: every node as its path of sibling "
                                              "ranks (the `paths` of a `specserve tune-tree` file).")

    @model_validator(mode="after")
    def _valid(self) -> "TreeSpec":
        self.config()  # TreeConfig's checks (node counts, a budget for a dynamic tree)
        return self

    def config(self) -> TreeConfig:
        paths = None if self.paths is None else tuple(tuple(p) for p in self.paths)
        branching = tuple(self.branching) or ((1,) if paths else ())  # with paths, TreeConfig derives it
        return TreeConfig(branching, self.max_nodes, dynamic=self.dynamic, paths=paths)


class DrafterConfig(_Strict):
    draft: str = Field(
        PROMPT_LOOKUP,
        description="What drafts, in the words of the CLI's --draft: 'prompt-lookup' (n-gram copy from the context, "
        "run inside the coordinator: microseconds, a network hop would cost more than the draft); 'suffix' (suffix "
        "decoding over the context and the outputs this coordinator replica finished, run inside it: "
        "pipeline.suffix.SuffixDrafter); a draft model "
        "(folder, .gguf or shipped name, e.g. 'smollm2-135m-distill') on drafter replicas; 'lookup+MODEL' (prompt "
        "lookup where the context repeats an n-gram, the model on drafter replicas elsewhere: "
        "pipeline.drafters.HybridDrafter); 'synthetic:ALPHA:SHAPE:RECORDING' (a measurement aid on drafter replicas: "
        "the target's recorded greedy continuation, each position kept with probability ALPHA, at the cost of a "
        "draft model of SHAPE: pipeline.synthetic); 'none': target-only decoding.",
    )
    resources: Resources = Field(default_factory=Resources)
    max_batch_size: int = Field(16, ge=1, description="Most KV-cache slots per drafter replica (requests it drafts "
                                "for at once); the memory budget may allow fewer.")
    kv_cache_gb: Optional[float] = Field(
        None, gt=0, description="KV-cache memory of a drafter worker, GiB (as target.kv_cache_gb).")
    kv_cache_fraction: float = Field(
        0.9, gt=0, le=1, description="As target.kv_cache_fraction, for a drafter worker (CUDA only).")
    batch_wait_ms: float = Field(0.0, ge=0, le=50, description="As for the target; 0: never wait.")
    head_placement: Literal["target", "drafter"] = Field(
        "target",
        description="Where a feature head (draft 'eagle3:DIR' or 'medusa:DIR', or one behind prompt lookup, "
        "'lookup+eagle3:DIR') runs. 'target': inside the target worker, which drafts each step's block itself right "
        "before verifying it (no hop; the head's cache slot lives with the request's target slot; prompt lookup, if "
        "any, runs there too, over the worker's copy of the committed context). 'drafter': on drafter replicas, fed "
        "with the target's hidden states of the committed positions that each verdict carries (EAGLE-3: the three "
        "auxiliary layers' states; Medusa: the final normed state); no pre-speculation. Ignored for other drafters.",
    )
    tree: Optional[TreeSpec] = Field(
        None,
        description="Token trees instead of chains: the request's K caps the tree's depth, the target verifies every "
        "node in one pass with its tree attention and keeps the accepted path in its cache. Drafted by a feature head "
        "alone ('eagle3:DIR' or 'medusa:DIR', not behind prompt lookup) in the target worker (head_placement "
        "'target'), or by a draft model alone (not 'lookup+MODEL'; a static shape) on drafter replicas "
        "(pipeline.tree.TreeDrafter), whose trees travel to the target as nodes, parents and sparse probabilities. "
        "With a draft model, pre-speculation and the adaptive K are off (chains only; logged). A target without "
        "tree attention (tensor parallel, the generic runner) keeps chains (logged).",
    )
    device: str = "cpu"
    dtype: str = "float32"

    @field_validator("draft")
    @classmethod
    def _draft_spec(cls, v: str) -> str:
        if v in ("prompt_lookup", "hybrid", "model", "default", "") or v == HYBRID_PREFIX:
            raise ValueError(f"drafter.draft={v!r}: use the CLI's words: '{PROMPT_LOOKUP}', '{SUFFIX}', a draft model "
                             f"(folder, .gguf or shipped name), '{HYBRID_PREFIX}MODEL' or '{NO_DRAFT}'")
        self_timed = is_synthetic(v) and parse_synthetic(v).self_timed  # a ValueError names the expected form
        if self_timed or is_self(v) or (v.startswith(HYBRID_PREFIX) and is_self(v[len(HYBRID_PREFIX):])):
            raise ValueError(f"drafter.draft={v!r}: self-speculation drafts with the target's own cache, in process "
                             "only (specserve generate, bench, SpeculativeEngine); Serve does not place it")
        return v

    @model_validator(mode="after")
    def _hybrid_head_in_target(self) -> "DrafterConfig":
        if is_head(self.draft) and self.draft.startswith(HYBRID_PREFIX) and self.head_placement != "target":
            raise ValueError(f"drafter.draft={self.draft!r}: a feature head behind prompt lookup runs in the target "
                             "worker only (head_placement 'target'), where the context the lookup reads is")
        if self.tree is not None:
            self._check_tree()
        return self

    def _check_tree(self) -> None:
        """Who drafts token trees in Serve: a feature head alone in the target worker, or a draft model alone."""
        hybrid = self.draft.startswith(HYBRID_PREFIX)
        if is_head(self.draft) and not hybrid and self.head_placement == "target":
            return
        if is_head(self.draft) or self.model is None or hybrid or is_synthetic(self.draft):
            raise ValueError(f"drafter.tree: token trees in Serve are drafted by a feature head alone ('eagle3:DIR' or "
                             f"'medusa:DIR') in the target worker (head_placement 'target'), or by a draft model "
                             f"alone on drafter replicas (e.g. 'smollm2-135m-distill', not behind "
                             f"'{HYBRID_PREFIX}'); drafter.draft is {self.draft!r}"
                             + (f" with head_placement {self.head_placement!r}" if is_head(self.draft) else ""))
        if self.tree.dynamic:
            raise ValueError(f"drafter.tree: a dynamic tree is drafted by an EAGLE-3 head; drafter.draft "
                             f"{self.draft!r} is a draft model, which drafts static shapes (leave out dynamic)")

    @property
    def drafts(self) -> bool:
        """Whether requests speculate at all."""
        return self.draft != NO_DRAFT

    @property
    def model(self) -> Optional[str]:
        """The draft model (a hybrid's model part); None for prompt lookup alone, suffix or none."""
        return draft_model_spec(self.draft)

    @property
    def uses_model(self) -> bool:
        """Whether this app drafts with a draft model (on drafter replicas)."""
        return self.model is not None

    @property
    def head(self) -> Optional[str]:
        """The feature head ('eagle3:DIR', 'medusa:DIR') if the drafter is one, else None."""
        return self.draft if is_head(self.draft) else None

    @property
    def head_in_target(self) -> bool:
        """Whether the target workers run the feature head (head_placement 'target')."""
        return self.head is not None and self.head_placement == "target"

    @property
    def runs_drafters(self) -> bool:
        """Whether this app runs drafter replicas: a draft model, or a feature head placed on them."""
        return self.uses_model or (self.head is not None and self.head_placement == "drafter")

    def with_model(self, model: str) -> "DrafterConfig":
        """The same drafter with its model named by `model` (e.g. the resolved folder)."""
        hybrid = self.draft.startswith(HYBRID_PREFIX)
        return self.model_copy(update={"draft": (HYBRID_PREFIX if hybrid else "") + model})


class CoordinatorConfig(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(256, ge=1, description="Concurrent request loops per coordinator.")
    overlap: bool = Field(
        True, description="Draft the next block while the current one is verified (optimistic: assumes "
        "every draft token and the drafter's guess of the bonus token are accepted; discarded otherwise). Not with "
        "a feature head: its next draft needs the target's states of the step's outcome."
    )
    prespec_branches: int = Field(
        PRESPEC_BRANCHES, ge=1, le=16,
        description="With overlap: outcomes of a step (accepted length, recovered or bonus token; ranked by the "
        "drafter's own probabilities, pipeline.prespec) whose next draft the drafter prepares while the target "
        "verifies, in one batched pass. Each costs a drafter KV-cache slot per request. 1: only the most likely one."
    )
    prespec_top_m: int = Field(
        2, ge=1, le=8, description="Next-token candidates per accepted length that pre-speculation ranks."
    )
    adaptive_k: bool = Field(
        True, description="Greedy requests draft 0..K tokens per step, whichever the step times and acceptance this "
        "coordinator measures say pays most (pipeline.adaptive.AdaptiveK); sampled requests always draft their K, "
        "so a seeded request replays exactly."
    )
    steps_per_call: int = Field(
        8, ge=1, le=64,
        description="Target passes one call to a target worker may run for a request when the worker needs nothing "
        "from elsewhere between them (the feature head in the target, or no drafts): the worker streams each step's "
        "verdict back as it is made and feeds the next pass itself, so the coordinator's round trip leaves the "
        "per-step path. 1: a call per step.",
    )
    draft_timeout_s: float = Field(10.0, gt=0, description="A drafter call slower than this counts as lost.")
    verify_timeout_s: float = Field(120.0, gt=0, description="A target call slower than this counts as lost.")
    replica_wait_s: float = Field(60.0, gt=0, description="How long to wait for a target worker to (re)appear.")
    retry_after_s: int = Field(
        2, ge=1, description="Retry-After (seconds) of the 429 a request gets when every target replica's slot "
        "queue is full.")


class IngressConfig(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(256, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger request bodies get 413.")
    body_read_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="Longest wait for a request body to arrive in full: a client that sends fewer bytes than its "
        "Content-Length promises gets 408 and its connection is closed.",
    )
    api_keys: list[SecretStr] = Field(
        default_factory=lambda: [SecretStr(k) for k in envs.SPECSERVE_API_KEY],
        description="Keys a client must send as `Authorization: Bearer KEY` on every /v1 route (/health stays open). "
        "Empty: no key needed. Default: $SPECSERVE_API_KEY (comma-separated). Printed as '**********'.",
    )

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: list[SecretStr]) -> list[SecretStr]:
        for key in v:
            text = key.get_secret_value()
            if not text or text != text.strip() or not text.isprintable() or not text.isascii():
                raise ValueError("an API key must be non-empty printable ASCII without surrounding spaces")
        return v

    @field_serializer("api_keys", when_used="json")
    def _dump_keys(self, v: list[SecretStr], info: SerializationInfo) -> list[str]:
        """JSON dumps mask the keys, except with the context {"reveal_secrets": True}: how `build_app` hands
        them to the ingress replicas."""
        reveal = bool(info.context and info.context.get("reveal_secrets"))
        return [k.get_secret_value() if reveal else str(k) for k in v]


class SpecDefaults(_Strict):
    num_draft_tokens: int = Field(4, ge=0, le=64, description="K when a request does not say.")
    draft_top_k: int = Field(64, ge=1, description="Draft probabilities shipped per position (sparse).")


class RedisTLS(_Strict):
    """TLS to an external Redis (a rediss:// redis_url). Paths are read by every process that connects (ingress and
    coordinator replicas): they must exist on their nodes."""

    ca_file: Optional[str] = Field(
        None, description="PEM file of the CA(s) the server's certificate must chain to; None: the system's CAs."
    )
    cert_file: Optional[str] = Field(None, description="PEM client certificate, for servers that require one.")
    key_file: Optional[str] = Field(None, description="PEM private key of cert_file.")
    check_hostname: bool = Field(True, description="The certificate must name the URL's host.")

    @model_validator(mode="after")
    def _cert_with_key(self) -> "RedisTLS":
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("redis_tls: cert_file and key_file go together (a client certificate and its key)")
        return self


class AppConfig(_Strict):
    """Everything `build_app` needs. Round-trips through a Serve config file's `args:`."""

    # A validation error never echoes its input: redis_url may carry a password.
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), hide_input_in_errors=True)

    served_model_name: Optional[str] = Field(None, description="Model id in the API; None: the target's name.")
    target: TargetConfig = Field(default_factory=TargetConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    speculation: SpecDefaults = Field(default_factory=SpecDefaults)
    redis_url: Optional[str] = Field(
        default_factory=lambda: os.environ.get("REDIS_URL") or None,
        description="redis://[:password@]host:port/db, rediss://... for TLS (see redis_tls). None (and no REDIS_URL): "
        "an embedded Redis started by the app, with a password generated at each start.",
    )
    redis_tls: Optional[RedisTLS] = Field(None, description="TLS files for a rediss:// redis_url.")
    embedded_redis_bind: Literal["loopback", "node_ip"] = Field(
        "loopback",
        description="Where the embedded Redis listens (its password is required either way). 'loopback': 127.0.0.1, "
        "reachable only from its own node, so the Ingress and Coordinator replicas must run there (one machine; the "
        "cluster configs pin all three to the head). 'node_ip': the node's IP, for clusters whose Ingress or "
        "Coordinator replicas run on other nodes (traffic is not encrypted: use an external Redis with TLS on an "
        "untrusted network).",
    )
    redis_namespace: str = Field("specserve", min_length=1, description="Prefix of every Redis key.")
    request_ttl_s: int = Field(3600, ge=10, description="Redis TTL of a request's state after its last step.")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            scheme = v.split("://", 1)[0] + "://" if "://" in v else "no scheme"  # never echo a password
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {scheme}")
        return v

    @model_validator(mode="after")
    def _head_needs_one_shard(self) -> "AppConfig":
        if self.drafter.head is not None and self.target.tensor_parallel_size > 1:
            raise ValueError(f"drafter.draft={self.drafter.draft!r}: a feature head reads the target's hidden states, "
                             "which a tensor-parallel target does not return (target.tensor_parallel_size must be 1)")
        return self

    @property
    def model_tree(self) -> Optional[TreeConfig]:
        """The token tree the draft model on the drafter replicas drafts (`drafter.tree` with a draft model); None:
        chains, also for a tensor-parallel target, whose runner has no tree attention."""
        d = self.drafter
        if d.tree is None or not d.uses_model or self.target.tensor_parallel_size > 1:
            return None
        return d.tree.config()

    @model_validator(mode="after")
    def _tls_needs_rediss(self) -> "AppConfig":
        if self.redis_tls is not None and not (self.redis_url or "").startswith("rediss://"):
            raise ValueError("redis_tls applies to an external Redis over TLS: set redis_url to rediss://...")
        return self


# ---------------------------------------------------------------------------------------------------------
# Pure option computation
# ---------------------------------------------------------------------------------------------------------


def worker_bundles(resources: Resources, tensor_parallel_size: int) -> list[dict[str, float]]:
    """One placement bundle per worker rank, or [] when no placement group is needed (CPU, one shard)."""
    bundle: dict[str, float] = {}
    if resources.num_cpus > 0:
        bundle["CPU"] = resources.num_cpus
    if resources.num_gpus > 0:
        bundle["GPU"] = resources.num_gpus
    if resources.accelerator_type:
        # The same tiny claim Ray Serve LLM uses: pins the bundle to a node of that accelerator type.
        bundle[f"accelerator_type:{resources.accelerator_type}"] = 0.001
    if resources.memory_gb:
        bundle["memory"] = float(int(resources.memory_gb * 2**30))
    if tensor_parallel_size == 1 and resources.num_gpus == 0:
        return []
    if not bundle:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} on CPU needs num_cpus > 0 per worker: "
            "Ray placement bundles must claim some resource"
        )
    return [dict(bundle) for _ in range(tensor_parallel_size)]


def _model_deployment_options(
    name: str, resources: Resources, tensor_parallel_size: int, max_ongoing_requests: int
) -> dict[str, Any]:
    host_actor = {"num_cpus": 0}  # the host replica only relays control calls
    options: dict[str, Any] = {
        "name": name,
        "num_replicas": resources.num_replicas,
        "max_ongoing_requests": max_ongoing_requests,
        "ray_actor_options": host_actor,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 5.0,
    }
    bundles = worker_bundles(resources, tensor_parallel_size)
    if bundles:
        options["placement_group_bundles"] = bundles  # the host shares bundle 0 (it claims nothing itself)
        options["placement_group_strategy"] = "STRICT_PACK"  # tensor-parallel ranks on one node
    return options


def worker_actor_options(resources: Resources, has_placement_group: bool) -> dict[str, Any]:
    """Ray actor options of one worker. With a placement group the host adds the scheduling strategy
    (bundle index = rank) at runtime; the accelerator type is then already claimed by the bundle."""
    opts: dict[str, Any] = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus}
    if resources.memory_gb:
        opts["memory"] = int(resources.memory_gb * 2**30)
    if resources.accelerator_type and not has_placement_group:
        opts["accelerator_type"] = resources.accelerator_type
    opts["max_concurrency"] = 1000  # async actor: verify calls queue inside and are batched
    return opts


def deployment_options(config: AppConfig) -> dict[str, dict[str, Any]]:
    """Serve options of every deployment of the app, keyed by deployment name. Pure."""
    out: dict[str, dict[str, Any]] = {}
    out[TARGET] = _model_deployment_options(
        TARGET, config.target.resources, config.target.tensor_parallel_size, max_ongoing_requests=64
    )
    if config.drafter.runs_drafters:
        out[DRAFTER] = _model_deployment_options(
            DRAFTER, config.drafter.resources, 1, max_ongoing_requests=64
        )
    out[COORDINATOR] = {
        "name": COORDINATOR,
        "num_replicas": config.coordinator.num_replicas,
        "max_ongoing_requests": config.coordinator.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.coordinator.num_cpus},
        "health_check_period_s": 2.0,
        "graceful_shutdown_timeout_s": 5.0,
    }
    out[INGRESS] = {
        "name": INGRESS,
        "num_replicas": config.ingress.num_replicas,
        "max_ongoing_requests": config.ingress.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.ingress.num_cpus},
        "graceful_shutdown_timeout_s": 5.0,
    }
    if config.redis_url is None:
        out[EMBEDDED_REDIS] = {
            "name": EMBEDDED_REDIS,
            "num_replicas": 1,
            "ray_actor_options": {"num_cpus": 0},
            # as the model replicas: a redis-server that died is noticed (3 failed checks) and its replica replaced
            # within seconds, not Serve's default 30
            "health_check_period_s": 2.0,
        }
    return out

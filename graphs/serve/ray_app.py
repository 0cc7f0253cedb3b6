"""The server scaled out on Ray Serve: one engine per replica, the same OpenAI routes (extra ``[ray]``).

    serve run samples/serve_ray.yaml                        # the config file: replicas, autoscaling
    serve run graphs.serve.ray_app:build_app out_dir=spec-demo/onnx max_running=8   # or arguments

Each replica is a Ray actor that loads the export (graphs.load) and runs the app of
:mod:`graphs.serve.app` (its engine's thread, metrics, admission) as the deployment's ASGI ingress;
Ray's proxy spreads requests over the replicas (power of two choices on their queue lengths),
``max_ongoing_requests`` caps what one replica holds (set it to the replica's ``max_running +
max_queue``: our 429 then speaks before Ray's queue does), ``max_queued_requests`` bounds the
proxy's queue (beyond it Ray answers 503), and ``autoscaling_config`` adds replicas while ongoing
requests per replica stay above ``target_ongoing_requests``. A replica reports healthy only once
its engine runs (``check_health``), so no traffic reaches one that is loading.

On a Ray cluster the same config runs unchanged with ``serve deploy samples/serve_ray.yaml`` against
the cluster's address (``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on
the others); the export directory must exist at the same path on every node (or give each replica's
``out_dir`` a shared filesystem path). On one machine Ray core still listens on every interface:
docs/serve.md runs it in a network namespace with only loopback, and says where Ray's token
(``~/.ray/auth_token``) comes in. The connection limits of ``python -m graphs.serve`` are not here
(Ray's proxy owns the sockets); the app's own limits (body timeout, admission, the prep pool) are.
"""

from __future__ import annotations

from ray import serve

from graphs.serve.app import ServerState, create_app
from graphs.serve.config import ServeConfig

DEFAULTS = {
    "max_ongoing_requests": 72,  # = max_running + max_queue of ServeConfig's defaults
    "max_queued_requests": 256,
    "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8,
                           "upscale_delay_s": 10, "downscale_delay_s": 120},
    "ray_actor_options": {"num_cpus": 0.5},  # 4 replicas fit 2 cores: autoscaling 1-4 can add them
    "health_check_period_s": 10,
}


@serve.deployment(name="specexport", **DEFAULTS)
@serve.ingress()
class OpenAIServer:
    """One replica: one decoder, one engine, one worker thread; the routes of graphs.serve.app."""

    def __init__(self, out_dir: str, **config):
        cfg = ServeConfig(**config)
        self.state = ServerState(out_dir, cfg)
        self.state.load()  # before the replica takes traffic (Ray waits for __init__)

    def __serve_build_asgi_app__(self):
        return create_app(self.state.out_dir, self.state.config, state=self.state)

    def check_health(self):
        if self.state.status != "ready" or not self.state.worker.alive:
            raise RuntimeError(f"engine not running ({self.state.status}: {self.state.error})")

    def __del__(self):
        if getattr(self, "state", None) is not None and self.state.worker is not None:
            self.state.worker.stop(timeout=5)


def build_app(args: dict):
    """``serve run graphs.serve.ray_app:build_app out_dir=... [ServeConfig fields]``, or a config file's
    ``import_path`` with ``args``. Deployment options (replicas, autoscaling) belong in the config's
    ``deployments:`` section, or pass ``num_replicas`` / ``num_cpus`` here."""
    args = dict(args)
    if "out_dir" not in args:
        raise ValueError("build_app needs out_dir (an export directory)")
    out_dir = str(args.pop("out_dir"))
    options = {}
    if "num_replicas" in args:
        options["num_replicas"] = int(args.pop("num_replicas"))
        options["autoscaling_config"] = None
    if "num_cpus" in args:
        options["ray_actor_options"] = {"num_cpus": float(args.pop("num_cpus"))}
    fields = {f: _cast(f, v) for f, v in args.items()}
    unknown = sorted(set(fields) - set(ServeConfig.names()))
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; accepted: out_dir, num_replicas, num_cpus and "
                         f"{', '.join(ServeConfig.names())}")
    dep = OpenAIServer.options(**options) if options else OpenAIServer
    return dep.bind(out_dir, **fields)


def _cast(name: str, value):
    """``serve run`` passes key=value strings: numbers and booleans as ServeConfig declares them."""
    if not isinstance(value, str):
        return value
    default = getattr(ServeConfig(), name, None)
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    if isinstance(default, int) or name in ("max_model_len", "max_tokens", "threads"):
        return int(value)
    if isinstance(default, float) or name == "request_timeout":
        return float(value)
    return value

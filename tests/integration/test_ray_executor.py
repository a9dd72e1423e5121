"""The template build on a local Ray instance gives the same library as local processes."""
import pytest

from coral.scenario import load_scenario
from coral.templates.library import build_library, template_to_dict

ray = pytest.importorskip("ray")


@pytest.fixture
def local_ray():
    # "local": a Ray instance of its own, never one another process on this host started
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_ray_build_matches_local(local_ray, tmp_path):
    s = load_scenario("core")
    seen = []
    on_ray = build_library(s, n_max=2, executor="ray", cache_dir=tmp_path, progress=seen.append)
    local = build_library(s, n_max=2, cache_dir=None)
    assert len(seen) == 9  # one progress call per (model, phase): prefill, decode and colocated
    key = lambda lib: sorted((t.key, template_to_dict(t)["throughput_tok_per_s"]) for t in lib.templates)  # noqa: E731
    assert key(on_ray) == key(local)
    assert [st.model for st in on_ray.stats] == [st.model for st in local.stats]  # scenario order kept

"""POST /runs and /runs/validate refuse a placement that cannot fit in device memory (422 naming
the field to change, nothing stored) and accept one that fits."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import LiveAPI, long_context_model

pytestmark = pytest.mark.parametrize("live_api", ["sqlite"], indirect=True)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    # a long context: the KV cache a setting asks for is what the engine would allocate
    return long_context_model(tmp_path_factory.mktemp("models") / "micro-long")


def _config(kv_cache_gb: float, mode: str = "colocate", model: str = "/nonexistent/arith-micro") -> dict:
    return {"model": {"path": model, "preset": "micro"},
            # 16 prompts × 8 samples a generate: the long context's cache can use 4 GiB in bf16
            "train": {"max_steps": 2, "batch_size": 16},
            "rollout": {"kv_cache_gb": kv_cache_gb},
            "placement": {"mode": mode, "devices": 2, "device_type": "cpu", "device_memory_gb": 3}}


def test_placement_that_cannot_fit_is_422_naming_the_field_and_stores_nothing(live_api: LiveAPI,
                                                                             long_model: str) -> None:
    with httpx.Client(base_url=live_api.url + "/api/v1", timeout=30,
                      headers={"Authorization": f"Bearer {live_api.token}"}) as c:
        r = c.post("/runs", json={"experiment": "mem", "config": _config(6.0, model=long_model)})
        assert r.status_code == 422, r.text
        first = r.json()["detail"][0]
        assert first["path"] == "rollout.kv_cache_gb"
        assert first["loc"] == ["body", "config", "rollout", "kv_cache_gb"]
        assert "does not fit" in first["msg"] and "would fit" in first["msg"]
        assert live_api.client.list_runs()["items"] == []
        v = c.post("/runs/validate", json={"config": _config(6.0, model=long_model)})
        assert v.status_code == 422 and v.json()["detail"][0]["path"] == "rollout.kv_cache_gb"
        # the value the message suggests is accepted, and the run is queued
        suggested = float(first["msg"].split("≤ ")[1].split()[0])
        assert c.post("/runs/validate", json={"config": _config(suggested, model=long_model)}).status_code == 200
        # the preset's short context caps the cache 6 GiB asks for at what it can fill: it fits
        assert c.post("/runs/validate", json={"config": _config(6.0)}).status_code == 200
        ok = c.post("/runs", json={"experiment": "mem", "config": _config(suggested, model=long_model)})
        assert ok.status_code == 201, ok.text
        assert ok.json()["config"]["placement"]["device_memory_gb"] == 3


def test_a_link_calibration_path_passes_through_and_an_empty_one_is_422(live_api: LiveAPI) -> None:
    # the API stores the path; the driver reads the file on the cluster (docs/placement.md)
    config = _config(1.0, mode="disaggregated")
    config["placement"]["link_calibration"] = "/cluster/share/link-calibration.json"
    with httpx.Client(base_url=live_api.url + "/api/v1", timeout=30,
                      headers={"Authorization": f"Bearer {live_api.token}"}) as c:
        assert c.post("/runs/validate", json={"config": config}).status_code == 200
        ok = c.post("/runs", json={"experiment": "link", "config": config})
        assert ok.status_code == 201, ok.text
        assert ok.json()["config"]["placement"]["link_calibration"] == "/cluster/share/link-calibration.json"
        config["placement"]["link_calibration"] = ""
        r = c.post("/runs/validate", json={"config": config})
        assert r.status_code == 422 and r.json()["detail"][0]["path"] == "placement.link_calibration"

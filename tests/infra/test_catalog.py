"""The instance catalog: facts checked against EC2's own instance-type data (moto's copy), prices, errors."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

import catalog


@pytest.fixture(scope="module")
def ec2_types():
    import moto

    path = Path(moto.__file__).parent / "ec2" / "resources" / "instance_types.json.gz"
    with gzip.open(path) as f:
        return json.load(f)


def test_ec2_facts_match_describe_instance_types(ec2_types):
    checked = 0
    for name in catalog.names("ec2"):
        it = catalog.get(name)
        ref = ec2_types.get(name)
        if ref is None:  # p3 is not in moto's copy; documented in catalog.py
            assert name.startswith("p3."), name
            continue
        checked += 1
        assert it.vcpus == ref["VCpuInfo"]["DefaultVCpus"], name
        assert it.memory_mib == ref["MemoryInfo"]["SizeInMiB"], name
        gpus = ref.get("GpuInfo", {}).get("Gpus", [])
        assert it.gpus == sum(g["Count"] for g in gpus), name
        if gpus:
            assert it.gpu_model == gpus[0]["Name"], name
            assert it.gpu_memory_mib == gpus[0]["MemoryInfo"]["SizeInMiB"], name
        assert it.network == ref["NetworkInfo"]["NetworkPerformance"], name
        assert it.efa == bool(ref["NetworkInfo"].get("EfaSupported")), name
        assert it.max_efa_interfaces == ref["NetworkInfo"].get("EfaInfo", {}).get("MaximumEfaInterfaces", 0), name
        assert it.instance_store_gb == ref.get("InstanceStorageInfo", {}).get("TotalSizeInGB", 0), name
    assert checked >= 12


def test_seed_facts_and_corrections():
    assert catalog.get("ml.g5.2xlarge").gpus == 1  # seed 000 plans 2
    assert catalog.get("ml.g5.2xlarge").processes_per_host == 1
    assert catalog.get("p4d.24xlarge").processes_per_host == 8
    assert catalog.get("m5.xlarge").processes_per_host == 1
    assert catalog.get("g5.12xlarge").gpus == 4
    assert catalog.get("p4d.24xlarge").efa and not catalog.get("g5.2xlarge").efa
    # the seeds' own neighbours are all there
    for n in [
        "p4d.24xlarge",
        "p5.48xlarge",
        "p3.2xlarge",
        "p3.8xlarge",
        "g6.12xlarge",
        "m5.xlarge",
        "ml.m5.xlarge",
        "ml.p4d.24xlarge",
        "ml.p3.2xlarge",
    ] + [
        f"g5.{s}" for s in ["xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge", "24xlarge", "48xlarge"]
    ]:
        assert catalog.get(n).name == n
    for it in catalog.INSTANCE_TYPES.values():
        assert it.on_demand.usd_per_hour > it.spot.usd_per_hour > 0, it.name
        assert it.on_demand.date and it.on_demand.source and it.spot.source, it.name
        assert (it.gpu is None) == (it.gpus == 0), it.name
        if it.platform == "sagemaker":  # same hardware, own price
            assert catalog.get(it.ec2_name).gpus == it.gpus


def test_unknown_type_error_lists_family():
    with pytest.raises(catalog.CatalogError, match=r"unknown instance type 'g5\.3xlarge'.*g5\.2xlarge"):
        catalog.get("g5.3xlarge")


def test_price_overrides(tmp_path):
    cat = catalog.with_prices({"g5.2xlarge": {"spot": 0.45}})
    assert cat["g5.2xlarge"].spot.usd_per_hour == 0.45
    assert cat["g5.2xlarge"].on_demand == catalog.get("g5.2xlarge").on_demand
    assert catalog.get("g5.2xlarge").spot.usd_per_hour != 0.45  # module table untouched
    for bad, msg in [
        ({"g5.2xlarge": {"spot": -1}}, "positive number"),
        ({"g5.2xlarge": {"reserved": 1.0}}, "unknown key 'reserved'"),
        ({"nope.large": {"spot": 1.0}}, "unknown instance type"),
        ({"g5.2xlarge": 3}, "must be a mapping"),
    ]:
        with pytest.raises(catalog.CatalogError, match=msg):
            catalog.with_prices(bad)
    f = tmp_path / "prices.json"
    f.write_text(json.dumps({"p4d.24xlarge": {"on_demand": 21.96}}))
    assert catalog.load_price_file(f)["p4d.24xlarge"].on_demand.source == str(f)
    with pytest.raises(catalog.CatalogError, match="does not exist"):
        catalog.load_price_file(tmp_path / "missing.json")
    f.write_text("{not json")
    with pytest.raises(catalog.CatalogError, match="not valid JSON"):
        catalog.load_price_file(f)


def test_catalog_imports_without_torch_or_cdk():
    code = "import sys, catalog; assert 'torch' not in sys.modules and 'aws_cdk' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])

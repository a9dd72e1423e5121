"""Catalog lookups, loaders and errors."""
import pytest

from coral.catalog import builtin_catalog, load_prices_csv, load_skypilot_vms_csv
from coral.errors import CoralError, UnknownNameError


def test_builtin_regions_and_configs():
    cat = builtin_catalog()
    assert cat.regions == ("aws:ap-northeast-2", "aws:us-east-1", "aws:us-east-2", "gcp:us-central1")
    for name in ("1xL4", "4xL40S", "8xH100", "1xA100-40GB", "1xT4", "1xV100-16GB"):
        assert name in cat.configs
    # aliases from the price data resolve to our names
    assert cat.config("1xV100").name == "1xV100-16GB"
    assert cat.gpu("A100").name == "A100-40GB"


def test_cheapest_instance_is_the_offer():
    cat = builtin_catalog()
    offer = cat.offer("aws:us-east-2", "1xL40S")
    # g6e.xlarge is the cheapest 1xL40S in us-east-2 (1.861 $/h); larger hosts cost more
    assert offer is not None and offer.instance_type == "g6e.xlarge" and offer.price_usd_per_h == 1.861
    assert cat.offer("aws:us-east-2", "2xL40S") is None  # AWS sells no 2-GPU L40S


def test_unsold_shape_is_still_a_node():
    cat = builtin_catalog()
    assert "2xL40S" not in cat.configs
    assert cat.config("2xL40S").memory_bytes == 2 * cat.gpu("L40S").memory_bytes


def test_unknown_names_list_valid_ones():
    cat = builtin_catalog()
    with pytest.raises(UnknownNameError, match="unknown GPU 'X100'; valid GPUs: A100-40GB"):
        cat.gpu("X100")
    with pytest.raises(UnknownNameError, match="unknown configuration '3xL4'"):
        cat.config("3xL4")
    with pytest.raises(CoralError, match="not of the form"):
        cat.config("L4")
    with pytest.raises(UnknownNameError, match="unknown region 'aws:mars-1'; valid regions: aws:ap-northeast-2"):
        cat.configs_in("aws:mars-1")


def test_price_csv_loader(tmp_path):
    p = tmp_path / "prices.csv"
    p.write_text("cloud,region,instance_type,gpu,gpu_count,price_per_hour,spot_price_per_hour\n"
                 "aws,eu-west-1,g6.xlarge,L4,1,0.9,\naws,eu-west-1,g6.2xlarge,L4,1,1.1,0.4\n")
    cat = load_prices_csv(p, builtin_catalog())
    assert cat.regions == ("aws:eu-west-1",)
    assert cat.offer("aws:eu-west-1", "1xL4").price_usd_per_h == 0.9


def test_price_csv_errors(tmp_path):
    p = tmp_path / "prices.csv"
    p.write_text("cloud,region,instance_type,gpu,gpu_count,price_per_hour\naws,x,g6.xlarge,L4,1,-3\n")
    with pytest.raises(CoralError, match="row 2: column 'price_per_hour' must be a finite number >= 0"):
        load_prices_csv(p, builtin_catalog())
    p.write_text("cloud,region,gpu\naws,x,L4\n")
    with pytest.raises(CoralError, match="missing columns"):
        load_prices_csv(p, builtin_catalog())
    with pytest.raises(CoralError, match="does not exist"):
        load_prices_csv(tmp_path / "nope.csv", builtin_catalog())


def test_skypilot_vms_loader(tmp_path):
    p = tmp_path / "vms.csv"
    p.write_text("InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,SpotPrice,Region,AvailabilityZone\n"
                 "g6e.xlarge,L40S,1,4,32,1.861,0.9,us-east-2,us-east-2a\n"
                 "g6e.xlarge,L40S,1,4,32,1.861,0.8,us-east-2,us-east-2b\n"
                 "m5.large,,,2,8,0.1,0.05,us-east-2,us-east-2a\n")
    cat = load_skypilot_vms_csv(p, builtin_catalog())
    assert cat.offer("aws:us-east-2", "1xL40S").price_usd_per_h == 1.861
    assert list(cat.configs) == ["1xL40S"]

"""``cost``: what is running in an environment and what it has cost so far, priced from the catalog.

Instances: hours since ``LaunchTime`` × the catalog's on-demand price, or for spot the latest spot price of
that type in that AZ (``describe_spot_price_history``) and the catalog's typical spot price when there is
none. SageMaker jobs: ``BillableTimeInSeconds`` (already net of managed-spot savings, SageMaker docs) × the
catalog's ml.* on-demand price. These are estimates: the bill is the truth (Cost Explorer lags ~24 h).
"""

from __future__ import annotations

import datetime as dt
from typing import Optional

from botocore.exceptions import ClientError

import catalog
from infra.cli import instances as inst
from infra.cli.session import Aws, explain


def _spot_price(ec2, instance_type: str, az: str) -> Optional[float]:
    try:
        hist = ec2.describe_spot_price_history(
            InstanceTypes=[instance_type], AvailabilityZone=az, ProductDescriptions=["Linux/UNIX"], MaxResults=1
        )
    except ClientError:
        return None
    prices = hist.get("SpotPriceHistory", [])
    return float(prices[0]["SpotPrice"]) if prices else None


def estimate(aws: Aws, now: Optional[dt.datetime] = None, ec2=None, sm=None) -> dict:
    """Rows for running instances and this env's recent training jobs, and the total in USD."""
    now = now or dt.datetime.now(dt.UTC)
    ec2 = ec2 or aws.client("ec2")
    sm = sm or aws.client("sagemaker")
    rows = []
    for i in inst.list_instances(aws, ec2):
        if i["state"] not in ("pending", "running"):
            continue
        it = catalog.INSTANCE_TYPES.get(i["type"])
        hours = max((now - i["launch_time"]).total_seconds(), 0) / 3600
        if i["market"] == "spot":
            live = _spot_price(ec2, i["type"], i["az"])
            rate, source = (
                (live, "spot price history")
                if live
                else ((it.spot.usd_per_hour, "catalog typical spot") if it else (None, "not in catalog"))
            )
        else:
            rate, source = (it.on_demand.usd_per_hour, "catalog on-demand") if it else (None, "not in catalog")
        rows.append(
            {
                "what": i["instance_id"],
                "type": i["type"],
                "market": i["market"],
                "hours": hours,
                "usd_per_hour": rate,
                "usd": rate * hours if rate else None,
                "price_source": source,
            }
        )
    try:
        jobs = sm.list_training_jobs(NameContains=f"trainstack-{aws.env}-", MaxResults=50)["TrainingJobSummaries"]
        for j in jobs:
            d = sm.describe_training_job(TrainingJobName=j["TrainingJobName"])
            itype = d["ResourceConfig"]["InstanceType"]
            it = catalog.INSTANCE_TYPES.get(itype)
            count = d["ResourceConfig"].get("InstanceCount", 1)
            billable = d.get("BillableTimeInSeconds") or 0
            rate = it.on_demand.usd_per_hour if it else None
            rows.append(
                {
                    "what": j["TrainingJobName"],
                    "type": itype,
                    "market": "managed spot" if d.get("EnableManagedSpotTraining") else "on-demand",
                    "hours": billable / 3600 * count,
                    "usd_per_hour": rate,
                    "usd": rate * billable / 3600 * count if rate else None,
                    "price_source": "billable seconds x catalog ml.* price",
                }
            )
    except ClientError as e:
        raise explain(e, "listing training jobs") from None
    total = sum(r["usd"] for r in rows if r["usd"] is not None)
    return {"rows": rows, "total_usd": total, "at": now.isoformat(timespec="seconds")}

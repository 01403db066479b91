"""User data of the training instances: one bash script, rendered per instance type.

What it does at boot, in order (each step logged to /var/log/trainstack-user-data.log):

0. Watchdog first: an EXIT trap. Any failing step (``set -euo pipefail``) deletes this instance's idle alarm and
   shuts the instance down (terminates: ``InstanceInitiatedShutdownBehavior=terminate``), unless it is tagged
   ``trainstack:keep=true`` (left up for inspection; its alarm then only notifies the SNS topic).
1. IMDSv2 token; instance id, region, lifecycle (spot/on-demand) and the job's instance tags
   (``trainstack:job``, ``trainstack:config``, ``trainstack:image-tag``, ``trainstack:image-digest``,
   ``trainstack:args``, ``trainstack:keep``; the launch templates turn on instance-metadata tags).
2. This instance's own "GPU idle -> stop/terminate" alarm (``/usr/local/bin/trainstack-alarm create``), before
   anything that can hang or fail, and the unit ``trainstack-alarm.service`` that re-creates it at every boot
   and deletes it at every shutdown (job done, spot interruption, the alarm's own action). Missing GPU data
   counts as idle, so a boot that hangs is stopped too.
3. Attach the data volume by *volume id* and find it through its NVMe by-id link
   (``/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol...``, EC2 user guide "Amazon EBS and NVMe"), never
   by guessing ``/dev/nvme1n1`` as seed 003 does; format it only if it has no file system; mount at /data.
   A volume still held by a reclaimed spot instance is retried for up to 10 minutes.
4. Mount FSx for Lustre at /fsx when the data stack has one. apt waits at most ``DPKG_LOCK_TIMEOUT_S`` for the
   dpkg lock (held by unattended-upgrades on a first boot).
5. CloudWatch agent with NVIDIA GPU, memory and disk metrics (``cloudwatch_agent.agent_config``).
6. Log in to ECR, write ``/etc/trainstack.env`` and a systemd unit running the training container with
   the image's ``train`` entrypoint and ``TRAINSTACK_NPROC_PER_NODE=<GPUs from the catalog>``.
   ``Restart=on-failure`` with ``RestartPreventExitStatus=2 3``: a run that stopped with a durable checkpoint
   (the entrypoint's exit 75) is restarted and resumes; a bad config (2) or a non-finite loss (3) is not
   retried. After 0, 2 or 3 ``trainstack-done`` deletes the idle alarm and shuts the instance down (terminates)
   unless it is tagged ``trainstack:keep=true``; it first writes the exit code to the job's exit record
   (``s3://<bucket>/jobs/<job>/exits/<instance id>.json``) for the recovery controller (infra/recovery.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from infra.constructs import cloudwatch_agent as agent
from infra.job_record import EXIT_KEY

CONTAINER_CHECKPOINTS = "/data/checkpoints"
CONTAINER_RUNS = "/data/runs"


@dataclass(frozen=True)
class UserDataParams:
    """Values baked into one launch template's user data (CDK tokens are fine in the str fields)."""

    env: str
    volume_id: str
    repository_uri: str
    train_log_group: str
    idle_alarm_command: str  # body of `trainstack-alarm create` (monitoring.instance_idle_alarm_command)
    idle_alarm_prefix: str  # alarm name = <prefix>-<instance id> (monitoring.idle_alarm_name)
    nproc_per_node: int
    efa: bool
    default_config: str
    default_image_tag: Optional[str]  # None: an instance without trainstack:image-digest/-tag tags fails to boot
    fsx_dns_name: Optional[str] = None
    fsx_mount_name: Optional[str] = None
    jobs_bucket: Optional[str] = None  # exit records go to s3://<jobs_bucket>/jobs/<job>/exits/<instance>.json


_HEAD = r"""set -euo pipefail
exec >>/var/log/trainstack-user-data.log 2>&1
echo "trainstack user data: start $(date -Is)"
# Watchdog first: any failing step (set -e) ends here, deletes this instance's idle alarm and shuts the instance
# down (terminate: InstanceInitiatedShutdownBehavior), unless it is tagged trainstack:keep=true (kept for
# inspection; its idle alarm then only notifies).
STEP=imds; IID=""; KEEP=""
boot_exit() {
  local rc=$?
  trap - EXIT
  [ "$rc" = 0 ] && return 0
  echo "trainstack user data: step $STEP failed with exit $rc at $(date -Is)"
  if [ "$KEEP" = true ]; then
    echo "trainstack user data: trainstack:keep=true, so the instance stays up (its idle alarm only notifies)"
    return "$rc"
  fi
  if [ -x /usr/local/bin/trainstack-alarm ]; then /usr/local/bin/trainstack-alarm delete || true; fi
  shutdown -h now "trainstack: boot step $STEP failed (exit $rc)"
  return "$rc"
}
trap boot_exit EXIT
IMDS=http://169.254.169.254/latest
TOKEN=$(curl -sS --retry 5 -X PUT "$IMDS/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 21600")
md() { curl -sSf --retry 5 -H "X-aws-ec2-metadata-token: $TOKEN" "$IMDS/meta-data/$1"; }
tag() { curl -sf -H "X-aws-ec2-metadata-token: $TOKEN" "$IMDS/meta-data/tags/instance/$1" || true; }
IID=$(md instance-id); REGION=$(md placement/region); LIFECYCLE=$(md instance-life-cycle)
KEEP=$(tag trainstack:keep)
export AWS_DEFAULT_REGION="$REGION"
"""

_ALARM = r"""# --- this instance's idle alarm, before anything that can hang or fail ---
STEP=idle-alarm
cat > /etc/trainstack-alarm.env <<ALARM_ENV_EOF
IID=$IID
REGION=$REGION
LIFECYCLE=$LIFECYCLE
KEEP=$KEEP
ALARM_ENV_EOF
cat > /usr/local/bin/trainstack-alarm <<'ALARM_EOF'
#!/bin/bash
# trainstack-alarm create|delete: this instance's "GPU idle -> stop/terminate" alarm (notify only when kept).
set -euo pipefail
. /etc/trainstack-alarm.env
create() {
{create}
}
case "${1:-}" in
  create) create ;;
  delete) aws cloudwatch delete-alarms --region "$REGION" --alarm-names "{prefix}-$IID" ;;
  *) echo "usage: trainstack-alarm create|delete" >&2; exit 2 ;;
esac
ALARM_EOF
chmod +x /usr/local/bin/trainstack-alarm
/usr/local/bin/trainstack-alarm create
# Created again at every boot (a stopped instance started again), deleted at every shutdown (job done, spot
# interruption, the alarm's own stop/terminate): it never outlives the instance's uptime.
cat > /etc/systemd/system/trainstack-alarm.service <<'UNIT_EOF'
[Unit]
Description=Trainstack idle alarm of this instance (created at boot, deleted at shutdown)
Wants=network-online.target
After=network-online.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/bin/trainstack-alarm create
ExecStop=/usr/local/bin/trainstack-alarm delete

[Install]
WantedBy=multi-user.target
UNIT_EOF
systemctl daemon-reload
systemctl enable --now trainstack-alarm.service
"""

_VOLUME = r"""# --- data volume, by id ---
STEP=data-volume
DEV="/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_${VOL//-/}"
for i in $(seq 1 60); do
  HOLDER=$(aws ec2 describe-volumes --volume-ids "$VOL" --query 'Volumes[0].Attachments[0].InstanceId' --output text)
  [ "$HOLDER" = "$IID" ] && break
  if [ "$HOLDER" = "None" ]; then aws ec2 attach-volume --volume-id "$VOL" --instance-id "$IID" --device /dev/sdf || true; fi
  sleep 10
done
for i in $(seq 1 60); do [ -e "$DEV" ] && break; sleep 5; done
[ -e "$DEV" ] || { echo "data volume $VOL never appeared at $DEV"; exit 1; }
blkid "$DEV" >/dev/null || mkfs.ext4 -q -L trainstack-data "$DEV"
mkdir -p /data && mountpoint -q /data || mount -o noatime "$DEV" /data
grep -q "$DEV" /etc/fstab || echo "$DEV /data ext4 defaults,noatime,nofail 0 2" >> /etc/fstab
mkdir -p {ckpt} {runs}
"""

#: apt/dpkg wait at most this long for the dpkg lock (unattended-upgrades holds it on a fresh instance's
#: first boot), then the step fails and the watchdog shuts the instance down.
DPKG_LOCK_TIMEOUT_S = 900

_FSX = r"""# --- FSx for Lustre ---
STEP=fsx
if ! command -v mount.lustre >/dev/null; then
  apt-get -o DPkg::Lock::Timeout={lock} update -q
  apt-get -o DPkg::Lock::Timeout={lock} install -y -q "lustre-client-modules-$(uname -r)" \
    || apt-get -o DPkg::Lock::Timeout={lock} install -y -q lustre-client-modules-aws
fi
mkdir -p /fsx && mountpoint -q /fsx || mount -t lustre -o relatime,flock "{dns}@tcp:/{mount}" /fsx
"""

_AGENT = r"""# --- CloudWatch agent (GPU, memory, disk; metrics.jsonl) ---
STEP=cloudwatch-agent
CWA=/opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl
if [ ! -x "$CWA" ]; then
  curl -sSfo /tmp/cwa.deb https://s3.amazonaws.com/amazoncloudwatch-agent/ubuntu/amd64/latest/amazon-cloudwatch-agent.deb
  apt-get -o DPkg::Lock::Timeout={lock} install -y -q /tmp/cwa.deb
fi
mkdir -p /opt/aws/amazon-cloudwatch-agent/etc
cat > /opt/aws/amazon-cloudwatch-agent/etc/trainstack.json <<'CWA_EOF'
{agent_config}
CWA_EOF
"$CWA" -a fetch-config -m ec2 -s -c file:/opt/aws/amazon-cloudwatch-agent/etc/trainstack.json
"""

_SERVICE = r"""# --- training container under systemd ---
STEP=training-service
REPO="{repo}"
JOB=$(tag trainstack:job); CONFIG=$(tag trainstack:config); IMAGE_TAG=$(tag trainstack:image-tag)
IMAGE_DIGEST=$(tag trainstack:image-digest); IMAGE_TAG=${IMAGE_TAG:-{image_tag}}
# By digest when launched by `python -m infra launch`: written once here, so every restart runs this image.
if [ -n "$IMAGE_DIGEST" ]; then IMAGE="$REPO@$IMAGE_DIGEST"
elif [ -n "$IMAGE_TAG" ]; then IMAGE="$REPO:$IMAGE_TAG"
else echo "no image: tag the instance trainstack:image-digest or trainstack:image-tag (python -m infra launch does)"; exit 2
fi
cat > /etc/trainstack.env <<ENV_EOF
IMAGE=$IMAGE
JOB=${JOB:-default}
CONFIG=${CONFIG:-{config}}
ARGS="$(tag trainstack:args)"
NPROC={nproc}
EFA={efa}
REGION=$REGION
IID=$IID
LOG_GROUP={log_group}
KEEP=$(tag trainstack:keep)
EXIT_URI="{exit_uri}"
ENV_EOF
aws ecr get-login-password | docker login --username AWS --password-stdin "${REPO%%/*}"
cat > /usr/local/bin/trainstack-run <<'RUN_EOF'
#!/bin/bash
# One attempt of the job through the image's `train` entrypoint (docs/training-image.md): it starts torchrun
# with NPROC ranks and exits 75 when the run stopped with a durable checkpoint (systemd then starts us again
# and the trainer resumes), 2 for a bad config, 0 when done (the model goes to /data/runs/$JOB/model).
set -u
. /etc/trainstack.env
mkdir -p {ckpt}/"$JOB" {runs}/"$JOB"
DEVICES=""
if [ "$EFA" = 1 ]; then for d in /dev/infiniband/uverbs*; do DEVICES="$DEVICES --device=$d"; done; fi
docker pull "$IMAGE" || echo "pull failed; using the local copy of $IMAGE if any"
docker rm -f "trainstack-$JOB" 2>/dev/null || true
# shellcheck disable=SC2086
exec docker run --rm --name "trainstack-$JOB" --gpus all --ipc=host --network host $DEVICES \
  --ulimit memlock=-1 --ulimit stack=67108864 -v /data:/data -v /fsx:/fsx \
  -e TRAINSTACK_NPROC_PER_NODE="$NPROC" -e TRAINSTACK_SM_ROOT={runs}/"$JOB" \
  --log-driver awslogs --log-opt awslogs-region="$REGION" --log-opt awslogs-group="$LOG_GROUP" \
  --log-opt awslogs-stream="$IID/$JOB" "$IMAGE" \
  train --config "$CONFIG" --checkpoint-dir {ckpt}/"$JOB" --log-dir {runs}/"$JOB" $ARGS
RUN_EOF
cat > /usr/local/bin/trainstack-done <<'DONE_EOF'
#!/bin/bash
# ExecStopPost: after a final result (0 done; 2/3 bad config/data or non-finite loss, never retried) delete the
# idle alarm and shut down unless kept; after 75 (interrupted, checkpoint saved) or any other failure systemd
# starts the job again (Restart=on-failure) and this does nothing.
. /etc/trainstack.env
case "${EXIT_CODE:-}:${EXIT_STATUS:-}" in
  exited:0) WHAT="done" ;;
  exited:2|exited:3) WHAT="failed with exit $EXIT_STATUS (not retried)" ;;
  *) exit 0 ;;
esac
echo "trainstack: job $JOB $WHAT"
# The final exit code for the recovery controller (infra/recovery.py): an instance that ends without one
# was interrupted and is relaunched.
if [ -n "$EXIT_URI" ]; then
  echo "{\"exit_code\": $EXIT_STATUS, \"instance_id\": \"$IID\"}" | aws s3 cp - "$EXIT_URI" \
    || echo "trainstack: could not write the exit record $EXIT_URI"
fi
/usr/local/bin/trainstack-alarm delete || echo "trainstack: could not delete the idle alarm"
if [ "$KEEP" != true ]; then shutdown -h +1 "trainstack: job $JOB $WHAT"; fi
DONE_EOF
chmod +x /usr/local/bin/trainstack-run /usr/local/bin/trainstack-done
cat > /etc/systemd/system/trainstack-train.service <<'UNIT_EOF'
[Unit]
Description=Trainstack training container (resumes from its checkpoint after exit 75)
After=docker.service network-online.target
Requires=docker.service
StartLimitIntervalSec=0

[Service]
Type=simple
EnvironmentFile=/etc/trainstack.env
ExecStart=/usr/local/bin/trainstack-run
ExecStop=/usr/bin/docker stop -t 110 trainstack-${JOB}
Restart=on-failure
RestartSec=15
RestartPreventExitStatus=2 3
KillSignal=SIGTERM
TimeoutStopSec=120
ExecStopPost=/usr/local/bin/trainstack-done

[Install]
WantedBy=multi-user.target
UNIT_EOF
systemctl daemon-reload
systemctl enable --now trainstack-train.service
trap - EXIT
echo "trainstack user data: done $(date -Is)"
"""


def render(p: UserDataParams) -> str:
    """The whole user-data script (without the ``#!/bin/bash`` line, which CDK's UserData adds).

    Order: IMDS, this instance's idle alarm (the watchdog), data volume, FSx, CloudWatch agent, training
    service; a failing step shuts the instance down and deletes the alarm (see the module docstring).
    """
    parts = [
        _HEAD,
        _ALARM.replace("{create}", p.idle_alarm_command.rstrip("\n")).replace("{prefix}", p.idle_alarm_prefix),
        f'VOL="{p.volume_id}"\n',
        _VOLUME.replace("{ckpt}", CONTAINER_CHECKPOINTS).replace("{runs}", CONTAINER_RUNS),
    ]
    if p.fsx_dns_name:
        parts.append(
            _FSX.replace("{dns}", p.fsx_dns_name)
            .replace("{mount}", p.fsx_mount_name or "")
            .replace("{lock}", str(DPKG_LOCK_TIMEOUT_S))
        )
    parts.append(
        _AGENT.replace("{agent_config}", agent.agent_config(p.env)).replace("{lock}", str(DPKG_LOCK_TIMEOUT_S))
    )
    service = (
        _SERVICE.replace("{repo}", p.repository_uri)
        .replace("{image_tag}", p.default_image_tag or "")
        .replace("{config}", p.default_config)
        .replace("{nproc}", str(p.nproc_per_node))
        .replace("{efa}", "1" if p.efa else "0")
        .replace("{log_group}", p.train_log_group)
        .replace(
            "{exit_uri}",
            f"s3://{p.jobs_bucket}/" + EXIT_KEY.format(job="$JOB", instance_id="$IID") if p.jobs_bucket else "",
        )
        .replace("{ckpt}", CONTAINER_CHECKPOINTS)
        .replace("{runs}", CONTAINER_RUNS)
    )
    parts.append(service)
    return "".join(parts)

"""The EC2 checkers of tests/e2e/resources.py: the VPC and its network, security groups, the data volume and
the spot launch templates, each read back through the EC2 API."""

from __future__ import annotations

import base64

from tests.e2e.resources import _props, checker


@checker("AWS::EC2::VPC")
def _vpc(ctx, pid, res):
    vpc = ctx.client("ec2").describe_vpcs(VpcIds=[pid])["Vpcs"][0]
    assert vpc["CidrBlock"] == _props(res)["CidrBlock"], vpc
    return f"CIDR {vpc['CidrBlock']}"


@checker("AWS::EC2::Subnet")
def _subnet(ctx, pid, res):
    sn = ctx.client("ec2").describe_subnets(SubnetIds=[pid])["Subnets"][0]
    p = _props(res)
    assert sn["CidrBlock"] == p["CidrBlock"] and sn["AvailabilityZone"] == p["AvailabilityZone"], sn
    return f"{sn['AvailabilityZone']} {sn['CidrBlock']}"


@checker("AWS::EC2::RouteTable", "AWS::EC2::SubnetRouteTableAssociation")
def _route_table(ctx, pid, res):
    ctx.client("ec2").describe_route_tables(RouteTableIds=[pid.split("~")[0]])
    return "route table exists"


@checker("AWS::EC2::Route")
def _route(ctx, pid, res):
    table, cidr = pid.split("~")
    routes = ctx.client("ec2").describe_route_tables(RouteTableIds=[table])["RouteTables"][0]["Routes"]
    assert any(r.get("DestinationCidrBlock") == cidr for r in routes), f"{pid}: no route to {cidr}"
    return f"route to {cidr}"


@checker("AWS::EC2::InternetGateway")
def _igw(ctx, pid, res):
    ctx.client("ec2").describe_internet_gateways(InternetGatewayIds=[pid])
    return "exists"


@checker("AWS::EC2::VPCGatewayAttachment")
def _igw_attachment(ctx, pid, res):
    gws = ctx.client("ec2").describe_internet_gateways(Filters=[{"Name": "attachment.vpc-id", "Values": [pid]}])
    assert gws["InternetGateways"], f"no internet gateway attached to {pid}"
    return "internet gateway attached"


@checker("AWS::EC2::VPCEndpoint")
def _endpoint(ctx, pid, res):
    ep = ctx.client("ec2").describe_vpc_endpoints(VpcEndpointIds=[pid])["VpcEndpoints"][0]
    assert ep["ServiceName"].endswith(".s3"), ep["ServiceName"]
    return f"{ep['VpcEndpointType']} {ep['ServiceName']}"


@checker("AWS::EC2::FlowLog")
def _flow_log(ctx, pid, res):
    logs = ctx.client("ec2").describe_flow_logs(FlowLogIds=[pid])["FlowLogs"]
    assert logs, pid
    return f"traffic {logs[0]['TrafficType']}"


@checker("AWS::EC2::SecurityGroup")
def _sg(ctx, pid, res):
    sg = ctx.client("ec2").describe_security_groups(GroupIds=[pid])["SecurityGroups"][0]
    return f"{len(sg['IpPermissions'])} ingress, {len(sg['IpPermissionsEgress'])} egress rules"


@checker("AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroupEgress")
def _sg_rule(ctx, pid, res):
    p = _props(res)
    sg = ctx.client("ec2").describe_security_groups(GroupIds=[p["GroupId"]])["SecurityGroups"][0]
    egress = res["Type"].endswith("Egress")
    peer = p.get("DestinationSecurityGroupId" if egress else "SourceSecurityGroupId")
    rules = sg["IpPermissionsEgress" if egress else "IpPermissions"]
    assert any(
        r["IpProtocol"] == str(p["IpProtocol"])
        and (not peer or any(g["GroupId"] == peer for g in r["UserIdGroupPairs"]))
        for r in rules
    ), f"{p['GroupId']}: no {'egress' if egress else 'ingress'} rule {p}"
    return f"{'egress' if egress else 'ingress'} {p['IpProtocol']} {'group' if peer else 'cidr'}"


@checker("AWS::EC2::Volume")
def _volume(ctx, pid, res):
    v = ctx.client("ec2").describe_volumes(VolumeIds=[pid])["Volumes"][0]
    p = _props(res)
    for key, api in (("Size", "Size"), ("VolumeType", "VolumeType"), ("Iops", "Iops"), ("Encrypted", "Encrypted")):
        if key in p:
            assert v.get(api) == p[key], f"{pid}: {api} {v.get(api)!r}, template {p[key]!r}"
    assert v["AvailabilityZone"] == p["AvailabilityZone"], v
    return f"{v['Size']} GiB {v['VolumeType']} {v.get('Iops')} IOPS in {v['AvailabilityZone']}"


@checker("AWS::EC2::LaunchTemplate")
def _launch_template(ctx, pid, res):
    v = ctx.client("ec2").describe_launch_template_versions(LaunchTemplateId=pid, Versions=["$Default"])
    data = v["LaunchTemplateVersions"][0]["LaunchTemplateData"]
    want = _props(res)["LaunchTemplateData"]
    assert data["InstanceType"] == want["InstanceType"], data["InstanceType"]
    spot = data.get("InstanceMarketOptions", {})
    assert spot.get("MarketType") == "spot", f"{pid}: not spot: {spot}"
    assert spot.get("SpotOptions", {}).get("InstanceInterruptionBehavior") == "terminate", spot
    assert data["MetadataOptions"]["HttpTokens"] == "required", f"{pid}: IMDSv2 not required"
    user_data = base64.b64decode(data["UserData"]).decode()
    for value in (ctx.outputs["DataVolumeId"], ctx.outputs["BucketName"]):
        assert value in user_data, f"{pid}: user data does not name {value}"
    assert "Token[" not in user_data and "Fn::" not in user_data, f"{pid}: unresolved user data"
    ami = data["ImageId"]
    ctx.client("ec2").describe_images(ImageIds=[ami])
    return (
        f"{data['InstanceType']} spot (max {spot['SpotOptions'].get('MaxPrice')} USD/h), IMDSv2, "
        f"{len(user_data)} B user data naming the volume and bucket, AMI {ami}"
    )

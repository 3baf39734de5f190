"""Real kubectl's `rollout history` and `rollout undo` against the local API server: they read the
ReplicaSets the Deployment controller keeps (pod-template-hash, revision annotations), as on a
real cluster — a server without them prints no revisions and cannot undo."""

from __future__ import annotations

import pytest

from moonlease_dev.testbed.kube import DEPLOYMENTS, REPLICASETS, LocalApiServer, is_rollout_complete
from tests.conformance.conftest import Kubectl, apply_ok, deployment_yaml, header

pytestmark = pytest.mark.conformance


def image_of(kube: LocalApiServer) -> str:
    return kube.get(DEPLOYMENTS, "default", "web")["spec"]["template"]["spec"]["containers"][0]["image"]


async def rolled_out(kube: LocalApiServer, image: str) -> None:
    await kube.wait_for(lambda: image_of(kube) == image and is_rollout_complete(kube.get(DEPLOYMENTS, "default", "web"))
                        and len([rs for rs in kube.list(REPLICASETS, "default")
                                 if rs["spec"]["template"]["spec"]["containers"][0]["image"] == image
                                 and rs["spec"]["replicas"] == 2]) == 1, what=f"web rolled out on {image}")


def history(output: str) -> list[tuple[str, str]]:
    """(REVISION, CHANGE-CAUSE) rows of `kubectl rollout history`."""
    rows = output.splitlines()[2:]
    return [tuple(row.split(None, 1)) for row in rows if row.strip()]  # type: ignore[misc]


async def test_rollout_history_and_undo_follow_the_replicasets(kube: LocalApiServer, kubectl: Kubectl) -> None:
    await apply_ok(kubectl, deployment_yaml(replicas=2))
    await rolled_out(kube, "nginx:1.27")
    changed = await kubectl("set", "image", "deploy/web", "web=nginx:1.28")
    assert changed.returncode == 0, changed.stderr
    await rolled_out(kube, "nginx:1.28")
    noted = await kubectl("annotate", "deploy/web", "kubernetes.io/change-cause=bump to 1.29")
    assert noted.returncode == 0, noted.stderr
    await kubectl("set", "image", "deploy/web", "web=nginx:1.29")
    await rolled_out(kube, "nginx:1.29")

    shown = await kubectl("rollout", "history", "deploy/web")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0] == "deployment.apps/web "
    assert history(shown.stdout) == [("1", "<none>"), ("2", "<none>"), ("3", "bump to 1.29")], shown.stdout
    one = await kubectl("rollout", "history", "deploy/web", "--revision=1")
    assert one.returncode == 0 and "with revision #1" in one.stdout and "nginx:1.27" in one.stdout, one.stdout

    # The ReplicaSets as a real controller leaves them: the current one scaled up, the old at zero.
    listed = await kubectl("get", "rs", "-l", "app=web")
    assert header(listed.stdout) == ["NAME", "DESIRED", "CURRENT", "READY", "AGE"]
    replicas = sorted((row.split()[1], row.split()[3]) for row in listed.stdout.splitlines()[1:])
    assert replicas == [("0", "0"), ("0", "0"), ("2", "2")], listed.stdout
    deployment = kube.get(DEPLOYMENTS, "default", "web")
    assert deployment["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "3"

    # Undo: back to revision 2's template, which becomes revision 4 (2 leaves the history).
    undone = await kubectl("rollout", "undo", "deploy/web")
    assert undone.returncode == 0 and "deployment.apps/web rolled back" in undone.stdout, undone.stderr
    await rolled_out(kube, "nginx:1.28")
    shown = await kubectl("rollout", "history", "deploy/web")
    assert [row[0] for row in history(shown.stdout)] == ["1", "3", "4"], shown.stdout
    assert len(kube.list(REPLICASETS, "default")) == 3  # the old template's ReplicaSet came back, none new

    # To a named revision; then one that does not exist, as kubectl reports it.
    back = await kubectl("rollout", "undo", "deploy/web", "--to-revision=1")
    assert back.returncode == 0, back.stderr
    await rolled_out(kube, "nginx:1.27")
    missing = await kubectl("rollout", "undo", "deploy/web", "--to-revision=9")
    assert missing.returncode == 1 and "unable to find specified revision 9 in history" in missing.stderr
    same = await kubectl("rollout", "undo", "deploy/web", "--to-revision=5")
    assert same.returncode == 0 and "skipped rollback (current template already matches revision 5)" in same.stdout


async def test_old_replicasets_past_the_history_limit_are_deleted(kube: LocalApiServer, kubectl: Kubectl) -> None:
    await apply_ok(kubectl, deployment_yaml(replicas=2).replace("  replicas: 2\n", "  replicas: 2\n  revisionHistoryLimit: 1\n"))
    for image in ("nginx:1.27", "nginx:1.28", "nginx:1.29"):
        done = await kubectl("set", "image", "deploy/web", f"web={image}")
        assert done.returncode == 0, done.stderr
        await rolled_out(kube, image)
    await kube.wait_for(lambda: len(kube.list(REPLICASETS, "default")) == 2, what="one old ReplicaSet kept")
    shown = await kubectl("rollout", "history", "deploy/web")
    assert [row[0] for row in history(shown.stdout)] == ["2", "3"], shown.stdout
    # Deleting the Deployment takes its ReplicaSets with it (they are owned).
    deleted = await kubectl("delete", "deploy", "web")
    assert deleted.returncode == 0, deleted.stderr
    assert kube.list(REPLICASETS, "default") == []

#!/usr/bin/env bash
# demo-kind.sh (`make demo`): Cairn on a real three-node kind cluster. Brings the cluster
# up (reused if it exists), builds and loads the images, deploys Cairn, has
# a pod write data to a three-replica PVC, fails a replica's node, shows
# the repair live, and verifies the data; restarts the instance manager
# under a writer; backs the volume up to an in-cluster S3 server and
# restores it into a new, larger claim on another node. Where ../shared/tools/kind-offline
# sits beside the clone (machines without registry access) it builds the
# kind node image and the CSI sidecars first: minutes the first time.
set -euo pipefail
cd "$(dirname "$0")/.."

source hack/kind-up.sh
k() { kubectl --context "kind-$CLUSTER" "$@"; }

say "a PVC (StorageClass cairn: 3 replicas, ext4) and a pod writing 64 MiB with its checksum"
# The app (so the engine) runs where the manager runs, if that is a worker:
# the node failed below is then the other worker, and the manager keeps
# repairing while it is down.
cp_nodes=$(k get nodes -l node-role.kubernetes.io/control-plane -o name | sed 's|node/||')
app_node=$(k -n cairn-system get pod -l app.kubernetes.io/component=manager -o jsonpath='{.items[0].spec.nodeName}')
if grep -qxF "$app_node" <<<"$cp_nodes"; then
  app_node=$(k get nodes -l '!node-role.kubernetes.io/control-plane' -o name | sed 's|node/||' | head -1)
fi
APP_IMAGE=${APP_IMAGE:-kind-offline/e2e-tools:local}
docker image inspect "$APP_IMAGE" >/dev/null 2>&1 || APP_IMAGE=debian:bookworm-slim
k apply -f - <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: demo}
spec:
  storageClassName: cairn
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 512Mi}}
---
apiVersion: v1
kind: Pod
metadata: {name: demo}
spec:
  nodeName: $app_node
  containers:
  - name: app
    image: $APP_IMAGE
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "cd /data && [ -f sum ] || { dd if=/dev/urandom of=blob bs=1M count=64 status=none && sha256sum blob > sum && sync; }; cat sum; sleep infinity"]
    volumeMounts: [{name: data, mountPath: /data}]
  volumes:
  - {name: data, persistentVolumeClaim: {claimName: demo}}
YAML
k wait pod/demo --for=condition=Ready --timeout=3m
pv=$(k get pvc demo -o jsonpath='{.spec.volumeName}')
until k exec demo -- test -f /data/sum 2>/dev/null; do sleep 1; done
k exec demo -- cat /data/sum
k -n cairn-system get volume "$pv"
k -n cairn-system get replicas -l storage.cairn.io/volume="$pv" -o wide

engine_node=$(k -n cairn-system get volume "$pv" -o jsonpath='{.status.currentNodeName}')
# A worker holding a replica but not the engine (stopping the control
# plane would stop the API server too).
victim=$(k -n cairn-system get replicas -l storage.cairn.io/volume="$pv" -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' |
  grep -vx "$engine_node" | grep -vxF "$cp_nodes" | head -1)
[[ -n $victim ]] || { echo "demo-kind: no worker holds a replica without the engine" >&2; exit 1; }
# A replica copies back the regions written while it was away and those
# written in the ~10 s before it left (their write-intent bits had not
# cleared yet: docs/engine.md). Left idle for 20 s first, the volume's
# bits are clean, so the resync below copies (almost) nothing.
say "the app is idle for 20 s (its write-intent bits clear)"
sleep 20
say "node $victim (a replica, not the engine) fails: docker stop $victim; started again once the volume is degraded"
docker stop "$victim" >/dev/null
show() { k -n cairn-system get volume "$pv" -o jsonpath='{.status.state} {.status.robustness} | {range .status.conditions[?(@.type=="Rebuilding")]}{.message}{end}'; echo; }
# Back at once: a replica failed for longer than the manager's
# --replenishment-wait (60 s) is not given back, and with three nodes its
# replacement has nowhere to go.
for _ in $(seq 24); do
  sleep 5; printf '   '; show
  [[ $(k -n cairn-system get volume "$pv" -o jsonpath='{.status.robustness}') == degraded ]] && break
done
docker start "$victim" >/dev/null
say "node $victim is back: its replica resyncs what it missed"
for _ in $(seq 60); do
  sleep 3; printf '   '; show
  [[ $(k -n cairn-system get volume "$pv" -o jsonpath='{.status.robustness}') == healthy ]] && break
done
# The engine keeps each replica's last rebuild in its status: what the
# returning replica copied, against the volume's size.
size=$(k -n cairn-system get volume "$pv" -o jsonpath='{.spec.size}')
case $size in
  *Gi) size=$((${size%Gi} << 30)) ;; *Mi) size=$((${size%Mi} << 20)) ;; *Ki) size=$((${size%Ki} << 10)) ;;
esac
resyncs=$(k -n cairn-system get engines -l storage.cairn.io/volume="$pv" \
  -o jsonpath='{range .items[*].status.rebuildStatus.*}{.state}|{.bytesDone}|{.dirtyOnly}|{.fullReason}{"\n"}{end}')
[[ -n $resyncs ]] || echo "   the engine records no rebuild of the returning replica"
while IFS='|' read -r state copied delta reason; do
  [[ -n $state ]] || continue
  if [[ $delta == true ]]; then kind="delta resync: only the regions written while it was away"
  else kind="full copy${reason:+: $reason}"; fi
  copied=${copied:-0}
  if ((copied < 1048576)); then copied="$((copied / 1024)) KiB"; else copied="$((copied / 1048576)) MiB"; fi
  echo "   the replica's resync: $state, copied $copied of the volume's $((size / 1048576)) MiB ($kind)"
done <<<"$resyncs"

say "the data, checked in the pod"
k exec demo -- sh -c 'cd /data && sha256sum -c sum'

say "the instance manager under the app is restarted (its pod deleted, as a crash or a rolling update does) while the app appends and fsyncs a record every 0.2 s"
# The writer counts failed appends and the longest time between two
# acknowledged ones: the pause the application saw.
k exec demo -- sh -c 'cd /data && : > log && echo 0 > /tmp/errors && echo 0 > /tmp/acked && echo 0 > /tmp/maxgap && rm -f /tmp/stop /tmp/writer
(i=0; errs=0; max=0; last=$(date +%s%3N)
while [ ! -f /tmp/stop ]; do
  i=$((i+1))
  if echo "rec $i" | dd of=/data/log oflag=append conv=notrunc,fsync status=none 2>/dev/null; then
    echo $i > /tmp/acked; now=$(date +%s%3N); gap=$((now-last)); last=$now
    if [ $gap -gt $max ]; then max=$gap; echo $max > /tmp/maxgap; fi
  else errs=$((errs+1)); echo $errs > /tmp/errors; i=$((i-1)); fi
  sleep 0.2
done; echo done > /tmp/writer) >/dev/null 2>&1 &'
sleep 5
im=$(k -n cairn-system get pod -l app.kubernetes.io/component=instance-manager --field-selector spec.nodeName="$engine_node" -o name)
echo "   deleting $im on $engine_node (the volume's engine runs there)"
k -n cairn-system delete "$im" --wait=false >/dev/null
for _ in $(seq 60); do
  sleep 3
  printf '   records acknowledged %s, failed writes %s, longest pause %s ms | ' "$(k exec demo -- cat /tmp/acked)" "$(k exec demo -- cat /tmp/errors)" "$(k exec demo -- cat /tmp/maxgap)"
  show
  new=$(k -n cairn-system get pod -l app.kubernetes.io/component=instance-manager --field-selector spec.nodeName="$engine_node" -o jsonpath='{.items[?(@.status.phase=="Running")].metadata.name}')
  [[ -n $new && pod/$new != "$im" && $(k -n cairn-system get volume "$pv" -o jsonpath='{.status.robustness}') == healthy ]] && break
done
k exec demo -- touch /tmp/stop
until [[ $(k exec demo -- cat /tmp/writer 2>/dev/null) == done ]]; do sleep 1; done
acked=$(k exec demo -- cat /tmp/acked) errors=$(k exec demo -- cat /tmp/errors)
k exec demo -- sh -c "seq 1 $acked | sed 's/^/rec /' | cmp - /data/log" && echo "   all $acked acknowledged records are in the log, in order"
echo "   failed writes seen by the app: $errors; longest pause between two fsyncs: $(k exec demo -- cat /tmp/maxgap) ms"
[[ $errors == 0 ]] || { echo "demo-kind: the app saw $errors failed writes" >&2; exit 1; }

say "a backup outside the cluster: an S3 server (versitygw) in the cluster stands in for the bucket"
S3_IMAGE=${S3_IMAGE:-cairn-demo-s3:local}
hack/s3-image.sh "$S3_IMAGE" "$APP_IMAGE" "$CLUSTER"
k apply -f - <<YAML
apiVersion: v1
kind: Namespace
metadata: {name: demo-s3}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: s3, namespace: demo-s3}
spec:
  selector: {matchLabels: {app: s3}}
  template:
    metadata: {labels: {app: s3}}
    spec:
      containers:
      - name: versitygw
        image: $S3_IMAGE
        imagePullPolicy: IfNotPresent
        command: ["sh", "-c", "mkdir -p /data/demo-backups && exec versitygw --access demo-access --secret demo-secret-key --port :7070 posix /data"]
        readinessProbe: {tcpSocket: {port: 7070}, periodSeconds: 1}
        volumeMounts: [{name: data, mountPath: /data}]
      volumes: [{name: data, emptyDir: {}}]
---
apiVersion: v1
kind: Service
metadata: {name: s3, namespace: demo-s3}
spec: {selector: {app: s3}, ports: [{port: 7070}]}
---
apiVersion: v1
kind: Secret
metadata: {name: demo-s3-credentials, namespace: cairn-system}
stringData: {AWS_ACCESS_KEY_ID: demo-access, AWS_SECRET_ACCESS_KEY: demo-secret-key}
---
apiVersion: storage.cairn.io/v1alpha1
kind: BackupTarget
metadata: {name: demo-s3}
spec:
  s3:
    endpoint: http://s3.demo-s3.svc.cluster.local:7070
    bucket: demo-backups
    region: us-east-1
    pathStyle: true
    credentialsSecret: {name: demo-s3-credentials, namespace: cairn-system}
---
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshotClass
metadata: {name: cairn-backup}
driver: storage.cairn.io
deletionPolicy: Delete
parameters: {type: backup, backupTarget: demo-s3}
YAML
k -n demo-s3 rollout status deploy/s3 --timeout=3m
k wait backuptarget/demo-s3 --for=condition=Available --timeout=2m
k get backuptargets
say "a VolumeSnapshot of the backup class: the volume's snapshot uploaded to the bucket"
k apply -f - <<YAML
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: demo-backup}
spec:
  volumeSnapshotClassName: cairn-backup
  source: {persistentVolumeClaimName: demo}
YAML
for _ in $(seq 100); do
  ready=$(k get volumesnapshot demo-backup -o jsonpath='{.status.readyToUse}')
  k -n cairn-system get backups -o custom-columns='BACKUP:.metadata.name,STATE:.status.state,PROGRESS:.status.progress,UPLOADED:.status.uploadedBytes' --no-headers 2>/dev/null | sed 's/^/   /'
  [[ $ready == true ]] && break
  sleep 3
done
[[ $ready == true ]] || { echo "demo-kind: the backup did not complete" >&2; exit 1; }
restore_node=$(k get nodes -l '!node-role.kubernetes.io/control-plane' -o name | sed 's|node/||' | grep -vx "$app_node" | head -1)
say "a new claim twice the size restored from the backup, read on $restore_node"
k apply -f - <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: demo-restored}
spec:
  storageClassName: cairn
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 1Gi}}
  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: demo-backup}
---
apiVersion: v1
kind: Pod
metadata: {name: demo-restored}
spec:
  nodeName: ${restore_node:-$app_node}
  containers:
  - name: app
    image: $APP_IMAGE
    imagePullPolicy: IfNotPresent
    command: ["sleep", "infinity"]
    volumeMounts: [{name: data, mountPath: /data}]
  volumes:
  - {name: data, persistentVolumeClaim: {claimName: demo-restored}}
YAML
k wait pod/demo-restored --for=condition=Ready --timeout=5m
k exec demo-restored -- sh -c 'cd /data && sha256sum -c sum && df -h /data | tail -1'

say "done"
cat <<TXT
Look around:  kubectl --context kind-$CLUSTER -n cairn-system get volumes,engines,replicas,snapshots -o wide
Backups:      kubectl --context kind-$CLUSTER -n cairn-system get backups; kubectl --context kind-$CLUSTER get volumesnapshots
Clean up:     kubectl --context kind-$CLUSTER delete pod/demo-restored pvc/demo-restored volumesnapshot/demo-backup pod/demo pvc/demo
              kind delete cluster --name $CLUSTER
TXT

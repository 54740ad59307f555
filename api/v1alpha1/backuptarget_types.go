package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// BackupTarget condition types.
const (
	// BackupTargetConditionAvailable is True when the target answered, the
	// credentials (S3) or the export's client list (NFS) let the manager
	// in, and a probe object was written, read back and deleted: backups
	// to it can start.
	BackupTargetConditionAvailable = "Available"
)

// BackupTarget condition reasons (condition Available). The message says
// what was tried and what to change.
const (
	// BackupTargetReasonAvailable: the probe listed, wrote, read back and
	// deleted an object under the target's prefix.
	BackupTargetReasonAvailable = "Available"
	// BackupTargetReasonCredentialsMissing: the credentials Secret does not
	// exist or lacks AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY. Create the
	// Secret, or add the key, named in the message.
	BackupTargetReasonCredentialsMissing = "CredentialsMissing"
	// BackupTargetReasonCABundleInvalid: the CA bundle's Secret or ConfigMap
	// or its key does not exist, or it holds no PEM certificate.
	BackupTargetReasonCABundleInvalid = "CABundleInvalid"
	// BackupTargetReasonUnreachable: no answer from the endpoint (or the
	// NFS server's portmapper, MOUNT or NFS service) within the probe's
	// timeout (refused, unresolvable, timed out, or a TLS certificate that
	// is not trusted: set caBundle). Check the URL or server and the
	// network path from the manager's pod.
	BackupTargetReasonUnreachable = "Unreachable"
	// BackupTargetReasonAccessDenied: the server refused the credentials or
	// the listing (wrong key, wrong secret, no permission on the bucket);
	// for NFS, the server refused to mount the export for the manager's
	// pod (not in the export's client list, or a Linux server refusing an
	// unprivileged source port: export with "insecure").
	BackupTargetReasonAccessDenied = "AccessDenied"
	// BackupTargetReasonBucketNotFound: the bucket does not exist. Cairn
	// never creates buckets; create it, or fix spec.s3.bucket.
	BackupTargetReasonBucketNotFound = "BucketNotFound"
	// BackupTargetReasonNotWritable: the bucket or export could be listed
	// but the probe object could not be written, read back identically or
	// deleted (read-only credentials, a bucket policy, object lock; a
	// read-only export, or a directory the squashed NFS user may not write).
	BackupTargetReasonNotWritable = "NotWritable"
	// BackupTargetReasonProbeFailed: the server answered the probe with an
	// error not covered above; the message holds the server's code.
	BackupTargetReasonProbeFailed = "ProbeFailed"
	// BackupTargetReasonExportNotFound: the NFS server's MOUNT service
	// does not export spec.nfs.path. Export it, or fix the path.
	BackupTargetReasonExportNotFound = "ExportNotFound"
)

// BackupTargetType is the kind of store a BackupTarget is.
// +kubebuilder:validation:Enum=s3;nfs
type BackupTargetType string

const (
	// BackupTargetTypeS3 is an S3-compatible bucket.
	BackupTargetTypeS3 BackupTargetType = "s3"
	// BackupTargetTypeNFS is an NFS export.
	BackupTargetTypeNFS BackupTargetType = "nfs"
)

// SecretReference names a Secret in a namespace.
type SecretReference struct {
	// name is the Secret's name.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$`
	Name string `json:"name"`
	// namespace is the Secret's namespace.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	Namespace string `json:"namespace"`
}

// KeyReference names one key of a Secret or ConfigMap in a namespace.
type KeyReference struct {
	// name is the object's name.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$`
	Name string `json:"name"`
	// namespace is the object's namespace.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	Namespace string `json:"namespace"`
	// key is the data key holding the PEM certificates.
	// +optional
	// +kubebuilder:default="ca.crt"
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[-._a-zA-Z0-9]+$`
	Key string `json:"key,omitempty"`
}

// CABundleSource says where the PEM CA certificates that the S3 endpoint's
// certificate must chain to are: one key of a Secret or of a ConfigMap.
// +kubebuilder:validation:XValidation:rule="has(self.secret) != has(self.configMap)",message="set exactly one of secret and configMap"
type CABundleSource struct {
	// secret names a Secret key holding the CA bundle.
	// +optional
	Secret *KeyReference `json:"secret,omitempty"`
	// configMap names a ConfigMap key holding the CA bundle.
	// +optional
	ConfigMap *KeyReference `json:"configMap,omitempty"`
}

// S3BackupTarget is an S3-compatible bucket (AWS S3, MinIO, Ceph RGW,
// versitygw, ...). The bucket must exist; Cairn never creates or deletes
// buckets.
type S3BackupTarget struct {
	// endpoint is the server's URL, scheme and host (and port) only:
	// "https://s3.eu-west-1.amazonaws.com", "http://10.0.0.5:7070" (http
	// only where the network is trusted).
	// +required
	// +kubebuilder:validation:MinLength=8
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="isURL(self) && url(self).getScheme() in ['http', 'https'] && url(self).getHostname() != '' && url(self).getEscapedPath() in ['', '/'] && url(self).getQuery().size() == 0",message="endpoint must be an http or https URL with a host and no path or query, such as https://s3.example.com"
	Endpoint string `json:"endpoint"`
	// bucket is the bucket's name (3 to 63 lower-case letters, digits, '.'
	// and '-', as S3 requires).
	// +required
	// +kubebuilder:validation:MinLength=3
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9][a-z0-9.-]*[a-z0-9]$`
	Bucket string `json:"bucket"`
	// prefix is put before every key Cairn writes ("cluster-a"), so several
	// clusters or targets can share a bucket. Empty uses the bucket's root.
	// +optional
	// +kubebuilder:validation:MaxLength=512
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9!_.*'()/-]*$`
	// +kubebuilder:validation:XValidation:rule="!self.split('/').exists(e, e == '.' || e == '..')",message="prefix must not contain '.' or '..' path elements"
	Prefix string `json:"prefix,omitempty"`
	// region is the bucket's region; empty lets the client ask the server.
	// +optional
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:Pattern=`^[a-z0-9-]*$`
	Region string `json:"region,omitempty"`
	// pathStyle addresses the bucket as https://endpoint/bucket (most
	// self-hosted servers) instead of https://bucket.endpoint.
	// +optional
	PathStyle bool `json:"pathStyle,omitempty"`
	// credentialsSecret names the Secret holding the credentials under the
	// keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and, for temporary
	// credentials, AWS_SESSION_TOKEN). The manager reads it when it checks
	// the target.
	// +required
	CredentialsSecret SecretReference `json:"credentialsSecret"`
	// caBundle, if set, is the only set of CAs trusted for the endpoint's
	// certificate (a private CA); otherwise the system's roots are.
	// +optional
	CABundle *CABundleSource `json:"caBundle,omitempty"`
	// checksum is what every object the manager writes carries for the
	// server to check its body against: MD5 (Content-MD5, which every
	// S3-compatible server checks; the default) or CRC32C
	// (x-amz-checksum-crc32c: far cheaper to compute, for a faster
	// backup, but only for a server that checks it, such as AWS S3: one
	// that ignores it would store a block damaged on the way, found only
	// when a restore verifies it).
	// +optional
	// +kubebuilder:validation:Enum=MD5;CRC32C
	Checksum S3Checksum `json:"checksum,omitempty"`
}

// S3Checksum is the checksum an S3 target's writes carry.
type S3Checksum string

// S3 checksums.
const (
	S3ChecksumMD5    S3Checksum = "MD5"
	S3ChecksumCRC32C S3Checksum = "CRC32C"
)

// NFSBackupTarget is a directory on an NFSv3 export. The manager speaks
// NFSv3 over TCP itself, from user space: it mounts nothing and needs no
// privilege. The export must let the manager's pods in from an
// unprivileged source port (Linux: the export option "insecure"), and the
// directory must be writable by the user the server maps the manager to
// (root, squashed to nobody unless "no_root_squash").
type NFSBackupTarget struct {
	// server is the NFS server's host name or IP address.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9.:\[\]-]+$`
	Server string `json:"server"`
	// path is the exported directory, absolute ("/exports/cairn").
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:Pattern=`^/[^\x00]*$`
	Path string `json:"path"`
	// prefix is a directory under the export that Cairn keeps its files
	// in ("cluster-a"), created if missing, so several clusters or
	// targets can share an export. Empty uses the export's root.
	// +optional
	// +kubebuilder:validation:MaxLength=512
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9!_.*'()/-]*$`
	// +kubebuilder:validation:XValidation:rule="!self.split('/').exists(e, e == '.' || e == '..')",message="prefix must not contain '.' or '..' path elements"
	Prefix string `json:"prefix,omitempty"`
	// port is the TCP port of the server's NFS service. Unset: asked of
	// the server's portmapper (port 111), as for a Linux server.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65535
	Port int32 `json:"port,omitempty"`
	// mountPort is the TCP port of the server's MOUNT service. Unset:
	// asked of the server's portmapper. A user-space server often serves
	// both on one port: set both to it.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65535
	MountPort int32 `json:"mountPort,omitempty"`
	// uid and gid are the AUTH_UNIX user and group every call of the
	// manager carries, and so own the files it writes unless the export
	// squashes them. Unset: 0 (root, which a Linux server's default
	// root_squash maps to its anonymous user). Set them to the owner of a
	// directory exported without squashing.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=4294967294
	UID int64 `json:"uid,omitempty"`
	// gid: see uid.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=4294967294
	GID int64 `json:"gid,omitempty"`
}

// BackupTargetSpec says where backups are stored: exactly one of s3 and nfs.
// +kubebuilder:validation:XValidation:rule="has(self.s3) != has(self.nfs)",message="set exactly one of s3 and nfs"
type BackupTargetSpec struct {
	// s3 is an S3-compatible bucket.
	// +optional
	S3 *S3BackupTarget `json:"s3,omitempty"`
	// nfs is an NFS export.
	// +optional
	NFS *NFSBackupTarget `json:"nfs,omitempty"`
	// pollInterval is how often the target is checked while it is
	// available (30s to 24h). A failing target is checked again sooner,
	// from 5 seconds on, backing off up to this interval.
	// +optional
	// +kubebuilder:default="5m"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('30s') && duration(self) <= duration('24h')",message="pollInterval must be between 30s and 24h"
	PollInterval *metav1.Duration `json:"pollInterval,omitempty"`
	// maxIncrementalBackups bounds a volume's chain of incremental backups
	// on this target: a backup whose parent already ends a run of this many
	// incremental backups in a row is made full instead (every block read
	// and uploaded again, so a block damaged on the target is written
	// anew). 0, the default: no bound (a backup is full only when it is the
	// volume's first, when no earlier one's snapshot is left on the
	// replicas, or when its spec.mode is full).
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=10000
	MaxIncrementalBackups int32 `json:"maxIncrementalBackups,omitempty"`
}

// BackupTargetStatus is what the BackupTarget reconciler observed.
type BackupTargetStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// type is s3 or nfs, from the spec.
	// +optional
	Type BackupTargetType `json:"type,omitempty"`
	// url names the target: s3://<bucket>/<prefix> at the endpoint, or
	// nfs://<server><path>/<prefix>.
	// +optional
	// +kubebuilder:validation:MaxLength=4096
	URL string `json:"url,omitempty"`
	// lastCheckTime is when the target was last probed.
	// +optional
	LastCheckTime *metav1.Time `json:"lastCheckTime,omitempty"`
	// conditions: Available.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// BackupTarget is a place outside the cluster where volume backups are
// stored: an S3-compatible bucket or an NFSv3 export. It is
// cluster-scoped; several may exist. The manager checks a target
// periodically (list, write, read back and delete a probe object under
// <prefix>/.cairn-probe/) and reports the result in condition Available.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Cluster,shortName=cbt,categories=cairn
// +kubebuilder:printcolumn:name="Type",type=string,JSONPath=`.status.type`,description="s3 or nfs"
// +kubebuilder:printcolumn:name="URL",type=string,JSONPath=`.status.url`,description="Bucket and prefix, or NFS export"
// +kubebuilder:printcolumn:name="Available",type=string,JSONPath=`.status.conditions[?(@.type=="Available")].status`,description="Reachable and writable"
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Available")].reason`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type BackupTarget struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec says where backups go.
	// +required
	Spec BackupTargetSpec `json:"spec"`

	// status is what Cairn observed.
	// +optional
	Status BackupTargetStatus `json:"status,omitempty"`
}

// BackupTargetList is a list of BackupTargets.
// +kubebuilder:object:root=true
type BackupTargetList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the BackupTargets.
	Items []BackupTarget `json:"items"`
}

func init() {
	SchemeBuilder.Register(&BackupTarget{}, &BackupTargetList{})
}

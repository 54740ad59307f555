package csi

import (
	"encoding/binary"
	"errors"
	"io"
)

// The node service reads a filesystem's geometry from its primary
// superblock to decide whether NodeStageVolume must grow it: growing an
// ext4 before mounting costs a full e2fsck, so it is done only when the
// grow tool would make the filesystem larger. Field offsets are those of
// the ext4 and XFS on-disk format documentation.

// errNoSuperblock is returned for a device whose superblock lacks its
// filesystem's magic number.
var errNoSuperblock = errors.New("no superblock magic number where the filesystem keeps it")

// readFilesystem reads the geometry of the filesystem of type fsType on r,
// a device of deviceSize bytes. For a mounted ext4 the read goes through
// the block device's page cache, which holds the superblock the kernel
// updates when it grows the filesystem; a mounted xfs's on-disk superblock
// may lag a grow, which errs towards growing again (a no-op).
func readFilesystem(r io.ReaderAt, fsType string, deviceSize int64) (Filesystem, error) {
	switch {
	case isExt(fsType):
		g, err := readExtGeometry(r)
		if err != nil {
			return Filesystem{}, err
		}
		bs := int64(g.blockSize)
		return Filesystem{Type: fsType, Size: int64(g.blocks) * bs,
			GrowsTo: int64(g.grownBlocks(uint64(deviceSize)/g.blockSize)) * bs}, nil
	case fsType == fsXFS:
		g, err := readXFSGeometry(r)
		if err != nil {
			return Filesystem{}, err
		}
		bs := int64(g.blockSize)
		return Filesystem{Type: fsType, Size: int64(g.blocks) * bs,
			GrowsTo: int64(g.grownBlocks(uint64(deviceSize)/g.blockSize)) * bs}, nil
	}
	return Filesystem{Type: fsType}, nil
}

// extGeometry is what of an ext2/3/4 superblock decides how resize2fs
// grows it.
type extGeometry struct {
	blocks, firstDataBlock, blocksPerGroup uint64
	blockSize, inodeTableBlocks            uint64
	descSize, reservedGDTBlocks            uint64
	// sparseSuper: backup superblocks only in groups 0, 1 and powers of
	// 3, 5 and 7; backupGroups: the two groups sparse_super2 keeps them
	// in (nil without sparse_super2).
	sparseSuper  bool
	backupGroups []uint64
}

const (
	extSuperblockOffset   = 1024
	extMagic              = 0xEF53
	extCompatSparseSuper2 = 0x200
	extIncompat64Bit      = 0x80
	extROCompatSparse     = 0x1
	// extMinGroupSlack is the room beyond a group's own metadata that
	// resize2fs and mke2fs want before they keep a last, partial group.
	extMinGroupSlack = 50
)

func readExtGeometry(r io.ReaderAt) (extGeometry, error) {
	sb := make([]byte, 1024)
	if _, err := r.ReadAt(sb, extSuperblockOffset); err != nil {
		return extGeometry{}, err
	}
	le := binary.LittleEndian
	if le.Uint16(sb[0x38:]) != extMagic {
		return extGeometry{}, errNoSuperblock
	}
	u32 := func(off int) uint64 { return uint64(le.Uint32(sb[off:])) }
	u16 := func(off int) uint64 { return uint64(le.Uint16(sb[off:])) }
	g := extGeometry{blocks: u32(0x4), firstDataBlock: u32(0x14), blocksPerGroup: u32(0x20),
		blockSize: 1024 << u32(0x18), reservedGDTBlocks: u16(0xCE), descSize: 32,
		sparseSuper: u32(0x64)&extROCompatSparse != 0}
	if u32(0x60)&extIncompat64Bit != 0 {
		g.blocks |= u32(0x150) << 32
		if d := u16(0xFE); d > 32 {
			g.descSize = d
		}
	}
	if u32(0x5C)&extCompatSparseSuper2 != 0 {
		g.backupGroups = []uint64{u32(0x24C), u32(0x250)}
	}
	inodeSize := u16(0x58)
	if u32(0x4C) == 0 { // revision 0: fixed 128-byte inodes
		inodeSize = 128
	}
	g.inodeTableBlocks = ceilDiv(u32(0x28)*inodeSize, g.blockSize)
	if g.blocksPerGroup == 0 || g.blockSize == 0 {
		return extGeometry{}, errNoSuperblock
	}
	return g, nil
}

// grownBlocks is the block count resize2fs gives the filesystem on a
// device of deviceBlocks blocks: all of them, less a last partial group
// with too little room for its own metadata and extMinGroupSlack blocks;
// never fewer than it has.
func (g extGeometry) grownBlocks(deviceBlocks uint64) uint64 {
	if deviceBlocks <= g.blocks {
		return g.blocks
	}
	span := deviceBlocks - g.firstDataBlock
	groups := ceilDiv(span, g.blocksPerGroup)
	if rem := span % g.blocksPerGroup; rem != 0 && groups > 1 {
		overhead := 2 + g.inodeTableBlocks // block and inode bitmaps, inode table
		if g.hasSuperblock(groups - 1) {
			overhead += 1 + ceilDiv(groups*g.descSize, g.blockSize) + g.reservedGDTBlocks
		}
		if rem < overhead+extMinGroupSlack {
			deviceBlocks -= rem
		}
	}
	return max(deviceBlocks, g.blocks)
}

// hasSuperblock reports whether group n holds a backup superblock (and
// group descriptors).
func (g extGeometry) hasSuperblock(n uint64) bool {
	switch {
	case n == 0:
		return true
	case g.backupGroups != nil:
		return n == g.backupGroups[0] || n == g.backupGroups[1]
	case !g.sparseSuper || n == 1:
		return true
	}
	for _, base := range []uint64{3, 5, 7} {
		p := base
		for p < n {
			p *= base
		}
		if p == n {
			return true
		}
	}
	return false
}

// xfsGeometry is what of an XFS superblock decides how xfs_growfs grows
// it.
type xfsGeometry struct {
	blocks, blockSize, agBlocks uint64
}

const (
	xfsMagic = 0x58465342 // "XFSB"
	// xfsMinAGBlocks is the smallest allocation group XFS makes: a
	// smaller last one is left out.
	xfsMinAGBlocks = 64
)

func readXFSGeometry(r io.ReaderAt) (xfsGeometry, error) {
	sb := make([]byte, 92)
	if _, err := r.ReadAt(sb, 0); err != nil {
		return xfsGeometry{}, err
	}
	be := binary.BigEndian
	if be.Uint32(sb) != xfsMagic {
		return xfsGeometry{}, errNoSuperblock
	}
	g := xfsGeometry{blockSize: uint64(be.Uint32(sb[4:])), blocks: be.Uint64(sb[8:]), agBlocks: uint64(be.Uint32(sb[84:]))}
	if g.blockSize == 0 || g.agBlocks == 0 {
		return xfsGeometry{}, errNoSuperblock
	}
	return g, nil
}

// grownBlocks is the block count xfs_growfs gives the filesystem on a
// device of deviceBlocks blocks: all of them, less a last allocation
// group under xfsMinAGBlocks; never fewer than it has.
func (g xfsGeometry) grownBlocks(deviceBlocks uint64) uint64 {
	if rem := deviceBlocks % g.agBlocks; rem != 0 && rem < xfsMinAGBlocks {
		deviceBlocks -= rem
	}
	return max(deviceBlocks, g.blocks)
}

func ceilDiv(a, b uint64) uint64 { return (a + b - 1) / b }

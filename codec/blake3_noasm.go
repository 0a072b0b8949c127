//go:build !amd64 || purego

package codec

var haveAVX512 = false

func hashChunks16(cvs *[8][16]uint32, buf *[group]byte, key *[8]uint32, counter uint32, flags uint32) {
	panic("codec: no AVX-512 kernels in this build")
}

func hashParents16(out *[8][16]uint32, in *[2][8][16]uint32, key *[8]uint32, flags uint32) {
	panic("codec: no AVX-512 kernels in this build")
}

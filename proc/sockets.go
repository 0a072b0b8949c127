package proc

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// TCPConn is an established TCP connection held by a process.
type TCPConn struct {
	PID           int
	Local, Remote string
}

func (c TCPConn) String() string {
	return fmt.Sprintf("process %d: %s -> %s", c.PID, c.Local, c.Remote)
}

// EstablishedTCP lists the established TCP connections the processes pids
// hold open. CRIU refuses to dump them without --tcp-established; knowing
// it before the GPU step spares a CUDA process a driver checkpoint that
// then has to be undone (which the driver may refuse: seen with NCCL).
// Unreadable processes are skipped: CRIU will say what it finds there.
func EstablishedTCP(pids []int) []TCPConn {
	var out []TCPConn
	tables := map[string]map[uint64][2]string{} // by network namespace
	for _, pid := range pids {
		inodes := socketInodes(pid)
		if len(inodes) == 0 {
			continue
		}
		ns, _ := os.Readlink(filepath.Join(Root, strconv.Itoa(pid), "ns", "net"))
		tab, ok := tables[ns]
		if !ok {
			tab = map[uint64][2]string{}
			for _, f := range []string{"tcp", "tcp6"} {
				readTCPTable(filepath.Join(Root, strconv.Itoa(pid), "net", f), tab)
			}
			tables[ns] = tab
		}
		for _, ino := range inodes {
			if c, ok := tab[ino]; ok {
				out = append(out, TCPConn{PID: pid, Local: c[0], Remote: c[1]})
			}
		}
	}
	return out
}

// socketInodes are the inodes of the sockets pid has open.
func socketInodes(pid int) []uint64 {
	dir := filepath.Join(Root, strconv.Itoa(pid), "fd")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var out []uint64
	for _, e := range ents {
		l, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		if s, ok := strings.CutPrefix(l, "socket:["); ok {
			if ino, err := strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 64); err == nil {
				out = append(out, ino)
			}
		}
	}
	return out
}

// tcpEstablished is the state column's value for ESTABLISHED.
const tcpEstablished = "01"

// readTCPTable adds the established entries of /proc/PID/net/tcp{,6} to
// tab, by inode.
func readTCPTable(path string, tab map[uint64][2]string) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Scan() // header
	for sc.Scan() {
		// sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
		fs := strings.Fields(sc.Text())
		if len(fs) < 10 || fs[3] != tcpEstablished {
			continue
		}
		ino, err := strconv.ParseUint(fs[9], 10, 64)
		if err != nil || ino == 0 {
			continue
		}
		tab[ino] = [2]string{tcpAddr(fs[1]), tcpAddr(fs[2])}
	}
}

// tcpAddr formats the kernel's "HEXIP:HEXPORT" (the address in host order
// per 32-bit word) as host:port.
func tcpAddr(s string) string {
	h, p, ok := strings.Cut(s, ":")
	b, err := hex.DecodeString(h)
	port, perr := strconv.ParseUint(p, 16, 16)
	if !ok || err != nil || perr != nil || (len(b) != 4 && len(b) != 16) {
		return s
	}
	for i := 0; i < len(b); i += 4 { // each word is little-endian
		b[i], b[i+1], b[i+2], b[i+3] = b[i+3], b[i+2], b[i+1], b[i]
	}
	return net.JoinHostPort(net.IP(b).String(), strconv.Itoa(int(port)))
}

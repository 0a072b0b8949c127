package proc

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// MappedFiles lists the files pid maps, each once, in the order of
// /proc/PID/maps; a file unlinked since keeps its name, without the
// kernel's " (deleted)". Nil when the process cannot be read.
func MappedFiles(pid int) []string {
	f, err := os.Open(filepath.Join(Root, strconv.Itoa(pid), "maps"))
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	seen := map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// address perms offset dev inode pathname (which may hold spaces)
		line := sc.Text()
		i := strings.IndexByte(line, '/')
		if i < 0 {
			continue
		}
		p := strings.TrimSuffix(line[i:], " (deleted)")
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	return out
}

// ThreadNames lists the names (comm) of pid's threads.
func ThreadNames(pid int) []string {
	files, _ := filepath.Glob(filepath.Join(Root, strconv.Itoa(pid), "task", "*", "comm"))
	var out []string
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil {
			out = append(out, strings.TrimSuffix(string(b), "\n"))
		}
	}
	return out
}

// UnixSocketNames lists the addresses of the unix sockets pid holds open,
// as /proc/PID/net/unix writes them ("@name" for an abstract one); unnamed
// sockets are left out. The kernel writes an abstract name's NUL bytes as
// '@', and NCCL pads its names with NULs to the whole sun_path: that padding
// is cut, so messages show the name a person would recognise.
func UnixSocketNames(pid int) []string {
	inodes := map[uint64]bool{}
	for _, ino := range socketInodes(pid) {
		inodes[ino] = true
	}
	if len(inodes) == 0 {
		return nil
	}
	f, err := os.Open(filepath.Join(Root, strconv.Itoa(pid), "net", "unix"))
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Scan() // header
	for sc.Scan() {
		// Num RefCount Protocol Flags Type St Inode Path
		fs := strings.Fields(sc.Text())
		if len(fs) < 8 {
			continue
		}
		if ino, err := strconv.ParseUint(fs[6], 10, 64); err == nil && inodes[ino] {
			name := fs[7]
			if len(name) > 1 && name[0] == '@' {
				name = "@" + strings.TrimRight(name[1:], "@")
			}
			out = append(out, name)
		}
	}
	return out
}

// LargestDeletedFile is the size of the largest regular file that the
// processes pids hold open or mapped after it was unlinked (what CRIU
// dumps as a ghost file, into the image), and that file's path; 0 if none.
// Mapped files are seen through map_files (root). Shared anonymous and
// System V memory ("/dev/zero (deleted)", "/SYSV...") look the same there
// but CRIU dumps them as memory: they are not counted.
func LargestDeletedFile(pids []int) (int64, string) {
	var most int64
	var path string
	for _, pid := range pids {
		for _, dir := range []string{"fd", "map_files"} {
			d := filepath.Join(Root, strconv.Itoa(pid), dir)
			ents, err := os.ReadDir(d)
			if err != nil {
				continue
			}
			for _, e := range ents {
				var st unix.Stat_t
				p := filepath.Join(d, e.Name())
				if unix.Stat(p, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Nlink != 0 || st.Size <= most {
					continue
				}
				link, _ := os.Readlink(p)
				if strings.HasPrefix(link, "/dev/zero") || strings.HasPrefix(link, "/SYSV") {
					continue
				}
				most, path = st.Size, link
			}
		}
	}
	return most, path
}

package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The repository's root, from this package's directory.
const repoRoot = "../.."

var (
	mdLink    = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	mdCode    = regexp.MustCompile("`[^`]*`")
	mdHeading = regexp.MustCompile(`^#{1,6}\s+(.*)`)
	mdAnchor  = regexp.MustCompile(`<a id="([^"]+)"`)
	slugDrop  = regexp.MustCompile(`[^\p{L}\p{N}_\- ]`)
)

// mdLines calls fn with each line of a markdown file outside fenced code.
func mdLines(t *testing.T, path string, fn func(n int, line string)) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	fenced := false
	for i, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
			continue
		}
		if !fenced {
			fn(i+1, line)
		}
	}
}

// mdAnchors are the fragments a link into path may name: its headings as
// GitHub slugs them (a repeated one gets -1, -2, ...) and its <a id>s.
func mdAnchors(t *testing.T, path string) map[string]bool {
	t.Helper()
	anchors := map[string]bool{}
	seen := map[string]int{}
	mdLines(t, path, func(_ int, line string) {
		if m := mdHeading.FindStringSubmatch(line); m != nil {
			h := mdLink.ReplaceAllString(strings.ReplaceAll(m[1], "`", ""), "]")
			h = strings.NewReplacer("[", "", "]", "").Replace(h)
			s := strings.ReplaceAll(slugDrop.ReplaceAllString(strings.ToLower(strings.TrimSpace(h)), ""), " ", "-")
			if n := seen[s]; n > 0 {
				anchors[s+"-"+strconv.Itoa(n)] = true
			} else {
				anchors[s] = true
			}
			seen[s]++
		}
		for _, m := range mdAnchor.FindAllStringSubmatch(line, -1) {
			anchors[m[1]] = true
		}
	})
	return anchors
}

// TestDocLinks: every relative link of README.md and docs/ names a file
// that is there and, with a #fragment, a heading or anchor of it; pages
// moved or rows renamed would otherwise leave links that lead nowhere.
func TestDocLinks(t *testing.T) {
	pages := []string{filepath.Join(repoRoot, "README.md")}
	for _, glob := range []string{"docs/*.md", "docs/*/*.md"} {
		m, err := filepath.Glob(filepath.Join(repoRoot, glob))
		if err != nil {
			t.Fatal(err)
		}
		pages = append(pages, m...)
	}
	anchors := map[string]map[string]bool{}
	for _, page := range pages {
		mdLines(t, page, func(n int, line string) {
			for _, m := range mdLink.FindAllStringSubmatch(mdCode.ReplaceAllString(line, ""), -1) {
				target := m[1]
				if strings.Contains(target, ":") { // https:, mailto:
					continue
				}
				file, frag, _ := strings.Cut(target, "#")
				path := page
				if file != "" {
					path = filepath.Join(filepath.Dir(page), file)
				}
				where := strings.TrimPrefix(page, repoRoot+"/")
				fi, err := os.Stat(path)
				if err != nil {
					t.Errorf("%s:%d: %s: no such file", where, n, target)
					continue
				}
				if frag == "" {
					continue
				}
				if fi.IsDir() || !strings.HasSuffix(path, ".md") {
					t.Errorf("%s:%d: %s: a fragment of a page that is not markdown", where, n, target)
					continue
				}
				if anchors[path] == nil {
					anchors[path] = mdAnchors(t, path)
				}
				if !anchors[path][frag] {
					t.Errorf("%s:%d: %s: no such heading or anchor", where, n, target)
				}
			}
		})
	}
}

// TestLayoutNamesEveryPackage: docs/DEVELOPING.md's layout table names
// every package of the module (a row of its own, or in its parent's row),
// so that a new package is placed in the map as it is in rooms.
func TestLayoutNamesEveryPackage(t *testing.T) {
	const mod = "github.com/gpucr/gpucr-stream/"
	b, err := os.ReadFile(filepath.Join(repoRoot, "docs/DEVELOPING.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n## Layout\n")
	if !ok {
		t.Fatal("docs/DEVELOPING.md has no Layout section")
	}
	var rows []string
	for _, line := range strings.Split(section, "\n") {
		if strings.HasPrefix(line, "|") {
			rows = append(rows, line)
		}
	}
	layout := strings.Join(rows, "\n")
	out, err := exec.Command("go", "list", mod+"...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, p := range strings.Fields(string(out)) {
		pkg := strings.TrimPrefix(p, mod)
		if strings.HasPrefix(pkg, "e2e/") { // e2e's programs are in e2e's row
			continue
		}
		top, _, _ := strings.Cut(pkg, "/")
		if !strings.Contains(layout, "| `"+top+"` |") && !strings.Contains(layout, "| `"+pkg+"` |") {
			t.Errorf("package %s: no row of the layout table in docs/DEVELOPING.md", pkg)
		} else if !strings.Contains(layout, "`"+pkg+"`") {
			t.Errorf("package %s: not named in the layout table of docs/DEVELOPING.md", pkg)
		}
	}
}

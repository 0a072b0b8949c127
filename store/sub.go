package store

import (
	"context"
	"io"
	"strings"
)

// Sub is the part of a store under prefix, as a store of its own: object
// "a" of the result is object prefix+"/a" of s. ls, rm and gc use it to
// read one checkpoint of a location that holds many.
func Sub(s Store, prefix string) Store {
	p := strings.Trim(prefix, "/")
	if p == "" {
		return s
	}
	return &subStore{s: s, p: p + "/"}
}

type subStore struct {
	s Store
	p string
}

func (u *subStore) String() string {
	return strings.TrimSuffix(u.s.String(), "/") + "/" + strings.TrimSuffix(u.p, "/")
}

func (u *subStore) Create(ctx context.Context, name string) (ObjectWriter, error) {
	return u.s.Create(ctx, u.p+name)
}

func (u *subStore) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	return u.s.Open(ctx, u.p+name, off, length)
}

func (u *subStore) Stat(ctx context.Context, name string) (ObjectInfo, error) {
	info, err := u.s.Stat(ctx, u.p+name)
	info.Name = strings.TrimPrefix(info.Name, u.p)
	return info, err
}

func (u *subStore) List(ctx context.Context, prefix string) ([]ObjectInfo, error) {
	objs, err := u.s.List(ctx, u.p+prefix)
	for i := range objs {
		objs[i].Name = strings.TrimPrefix(objs[i].Name, u.p)
	}
	return objs, err
}

// Parent implements Parent's interface: the prefix above the last
// component of u's.
func (u *subStore) Parent() (Store, string, bool) {
	p := strings.TrimSuffix(u.p, "/")
	if i := strings.LastIndex(p, "/"); i >= 0 {
		return Sub(u.s, p[:i]), p[i+1:], true
	}
	return u.s, p, true
}

// Parent is the store of the location that holds st (the directory of
// checkpoint directories, the S3 prefix above st's) and st's name in it,
// for stores that know (store/dir, store/s3, Sub); ok is false for others
// and at a root.
func Parent(st Store) (parent Store, name string, ok bool) {
	if p, is := st.(interface {
		Parent() (Store, string, bool)
	}); is {
		return p.Parent()
	}
	return nil, "", false
}

func (u *subStore) Delete(ctx context.Context, name string) error { return u.s.Delete(ctx, u.p+name) }

package analyzer

import (
	"go/ast"
	"go/types"
	"strings"
)

// checkEventIDs: rule reception-id, in every function of the package
// outside test files (tests produce the events they deliver).
func (c *checker) checkEventIDs() {
	for _, f := range c.pass.Files {
		if strings.HasSuffix(c.pass.Fset.File(f.Pos()).Name(), "_test.go") {
			continue
		}
		for _, d := range f.Decls {
			c.checkEventIDsIn(d)
		}
	}
}

// idScope is what rule reception-id knows about the variables of one
// top-level declaration, gathered in source order.
type idScope struct {
	fresh     map[types.Object]bool // holds a freshly generated id
	made      map[types.Object]bool // a message built here from its own payload
	received  map[types.Object]bool // a message from anywhere else
	copies    map[types.Object]bool // holds another message's Payload
	freshMsgs map[types.Object]bool // a message built here with a fresh id
}

func (c *checker) checkEventIDsIn(d ast.Decl) {
	s := &idScope{
		fresh:     make(map[types.Object]bool),
		made:      make(map[types.Object]bool),
		received:  make(map[types.Object]bool),
		copies:    make(map[types.Object]bool),
		freshMsgs: make(map[types.Object]bool),
	}
	unmarshal := false
	if fd, ok := d.(*ast.FuncDecl); ok {
		unmarshal = c.isUnmarshal(fd)
	}
	bind := func(lhs ast.Expr, rhs ast.Expr) {
		v := c.varOf(lhs)
		if v == nil {
			return
		}
		if c.isFresh(rhs, s) {
			s.fresh[v] = true
		}
		if c.payloadOf(rhs, s) {
			s.copies[v] = true
		}
		if isMessage(v.Type()) {
			if id, payload, ok := c.newMessage(rhs); ok && !c.payloadOf(payload, s) {
				s.made[v] = true
				if c.isFresh(id, s) {
					s.freshMsgs[v] = true
				}
			} else {
				s.received[v] = true
			}
		}
	}
	ast.Inspect(d, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.AssignStmt:
			if len(n.Lhs) == len(n.Rhs) {
				for i := range n.Lhs {
					bind(n.Lhs[i], n.Rhs[i])
				}
			} else if len(n.Rhs) == 1 {
				bind(n.Lhs[0], n.Rhs[0]) // id, err := uuid.NewV7()
			}
			for i, l := range n.Lhs {
				if len(n.Lhs) == len(n.Rhs) {
					c.checkUUIDAssign(l, n.Rhs[i], s, unmarshal)
				}
			}
		case *ast.ValueSpec:
			for i, name := range n.Names {
				if len(n.Names) == len(n.Values) {
					bind(name, n.Values[i])
				} else if len(n.Values) == 1 && i == 0 {
					bind(name, n.Values[0])
				}
			}
		case *ast.CallExpr, *ast.CompositeLit:
			id, payload, ok := c.newMessage(n.(ast.Expr))
			if !ok || !c.isFresh(id, s) {
				return true
			}
			switch {
			case unmarshal:
				c.report(n, ruleEventID, "idemvet: event id minted at reception (a message built with a fresh id in an Unmarshal): "+keepID)
			case c.payloadOf(payload, s):
				c.report(n, ruleEventID, "idemvet: event id minted at reception (another message's payload republished under a fresh id): "+keepID)
			}
		case *ast.SendStmt:
			if !isMessagePtr(c.typeOf(n.Value)) {
				return true
			}
			v := c.varOf(n.Value)
			id, _, built := c.newMessage(n.Value)
			if v != nil && s.freshMsgs[v] || built && c.isFresh(id, s) {
				c.report(n, ruleEventID, "idemvet: event id minted at reception (a message with a fresh id sent to a subscriber's channel): "+keepID)
			}
		}
		return true
	})
}

const keepID = "keep the producer's event id so that a redelivery carries the same id and is claimed once"

// checkUUIDAssign reports m.UUID = <fresh id> unless m is a message built in
// this declaration from a payload of its own, outside an Unmarshal.
func (c *checker) checkUUIDAssign(lhs, rhs ast.Expr, s *idScope, unmarshal bool) {
	sel, ok := ast.Unparen(lhs).(*ast.SelectorExpr)
	if !ok || sel.Sel.Name != "UUID" || !isMessage(c.typeOf(sel.X)) || !c.isFresh(rhs, s) {
		return
	}
	if v := c.varOf(sel.X); v != nil && s.made[v] && !s.received[v] && !unmarshal {
		return // a producer building its own message
	}
	c.report(sel, ruleEventID, "idemvet: event id minted at reception (a fresh id assigned to a received message's UUID): "+keepID)
}

// isUnmarshal reports whether fd is an unmarshal path: its name starts with
// Unmarshal and it returns a *message.Message.
func (c *checker) isUnmarshal(fd *ast.FuncDecl) bool {
	if !strings.HasPrefix(fd.Name.Name, "Unmarshal") {
		return false
	}
	fn, ok := c.pass.TypesInfo.Defs[fd.Name].(*types.Func)
	if !ok {
		return false
	}
	res := fn.Type().(*types.Signature).Results()
	for i := 0; i < res.Len(); i++ {
		if isMessagePtr(res.At(i).Type()) {
			return true
		}
	}
	return false
}

// isFresh reports whether e is a freshly generated id: a call of an
// idGenerators function, its String(), a Must(…) or conversion of one, or a
// variable of this declaration holding one.
func (c *checker) isFresh(e ast.Expr, s *idScope) bool {
	switch e := ast.Unparen(e).(type) {
	case *ast.Ident:
		return s.fresh[c.pass.TypesInfo.Uses[e]]
	case *ast.CallExpr:
		if tv, ok := c.pass.TypesInfo.Types[e.Fun]; ok && tv.IsType() && len(e.Args) == 1 {
			return c.isFresh(e.Args[0], s)
		}
		fn := c.callee(e)
		if fn == nil || fn.Pkg() == nil {
			return false
		}
		recv := fn.Type().(*types.Signature).Recv()
		switch {
		case recv == nil && idGenerators[fn.Pkg().Path()][fn.Name()]:
			return true
		case recv == nil && fn.Name() == "Must" && idGenerators[fn.Pkg().Path()] != nil && len(e.Args) == 1:
			return c.isFresh(e.Args[0], s)
		case recv != nil && fn.Name() == "String" && len(e.Args) == 0:
			if sel, ok := ast.Unparen(e.Fun).(*ast.SelectorExpr); ok {
				return c.isFresh(sel.X, s)
			}
		}
	}
	return false
}

// newMessage matches message.NewMessage(id, payload) and a
// message.Message{…} literal (or its address), returning the id and payload
// expressions (nil when absent).
func (c *checker) newMessage(e ast.Expr) (id, payload ast.Expr, ok bool) {
	e = ast.Unparen(e)
	if u, isAddr := e.(*ast.UnaryExpr); isAddr {
		e = ast.Unparen(u.X)
	}
	switch e := e.(type) {
	case *ast.CallExpr:
		if isFunc(c.callee(e), messagePath, newMessageFuncs) && len(e.Args) == 2 {
			return e.Args[0], e.Args[1], true
		}
	case *ast.CompositeLit:
		if !isMessage(c.typeOf(e)) {
			return nil, nil, false
		}
		for _, el := range e.Elts {
			kv, isKV := el.(*ast.KeyValueExpr)
			if !isKV {
				continue
			}
			if k, isID := kv.Key.(*ast.Ident); isID {
				switch k.Name {
				case "UUID":
					id = kv.Value
				case "Payload":
					payload = kv.Value
				}
			}
		}
		return id, payload, true
	}
	return nil, nil, false
}

// payloadOf reports whether e reads another message's Payload, directly or
// through a variable of this declaration.
func (c *checker) payloadOf(e ast.Expr, s *idScope) bool {
	if e == nil {
		return false
	}
	found := false
	ast.Inspect(e, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.SelectorExpr:
			if n.Sel.Name == "Payload" && isMessage(c.typeOf(n.X)) {
				found = true
			}
		case *ast.Ident:
			if s.copies[c.pass.TypesInfo.Uses[n]] {
				found = true
			}
		case *ast.FuncLit:
			return false
		}
		return !found
	})
	return found
}

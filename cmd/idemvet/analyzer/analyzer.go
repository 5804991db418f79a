package analyzer

import (
	"go/ast"
	"go/constant"
	"go/token"
	"go/types"

	"golang.org/x/tools/go/analysis"
	"golang.org/x/tools/go/types/typeutil"
)

// Analyzer reports the four idemvet rules; see the package documentation.
var Analyzer = &analysis.Analyzer{
	Name: "idemvet",
	Doc: `report effects that escape the idempotent consumer's transaction

idemvet checks the handlers attached with (*middleware.Consumer).AddConsumerHandler
and .AddHandler of github.com/watermill-idempotency/idempotency, and the functions
taking a *message.Message that read the attempt's transaction:
  pool-write      a write through *pgxpool.Pool, *pgx.Conn, *sql.DB, … instead of the attempt's transaction
  tx-end          Commit/Rollback (or Exec "COMMIT", …) of the attempt's transaction
  reception-id    a fresh UUID assigned to a received message (msg.UUID = watermill.NewUUID(), …)
  http-outside-op an HTTP call in a handler outside (*operation.Runner).Do
A line ending with "//idemvet:ignore <reason>" (or following one alone on its
line) is not reported. The package documentation defines each rule.`,
	URL:       "https://pkg.go.dev/github.com/watermill-idempotency/idempotency/cmd/idemvet/analyzer",
	Run:       run,
	FactTypes: []analysis.Fact{new(handlerFindings)},
}

// Rule names: the Category of each diagnostic.
const (
	rulePoolWrite = "pool-write"
	ruleTxEnd     = "tx-end"
	ruleEventID   = "reception-id"
	ruleHTTP      = "http-outside-op"
	ruleIgnore    = "ignore"
)

type checker struct {
	pass    *analysis.Pass
	ignores *ignores

	// decls: the functions and methods declared in this package.
	decls map[*types.Func]*ast.FuncDecl
	// funcLits: the function literals assigned to each variable.
	funcLits map[*types.Var][]*ast.FuncLit
	// inOp: the function literals passed to an operation scope
	// (Runner.Do), directly or through a variable.
	inOp map[*ast.FuncLit]bool

	reported map[reportKey]bool
	// sink, when set, receives the diagnostics instead of the pass
	// (handlerFacts).
	sink func(n ast.Node, rule, msg string)
	// handled: the functions declared here that were checked as handlers.
	handled map[*ast.FuncDecl]bool
}

type reportKey struct {
	pos token.Pos
	msg string
}

func run(pass *analysis.Pass) (any, error) {
	c := &checker{
		pass:     pass,
		ignores:  newIgnores(pass),
		decls:    make(map[*types.Func]*ast.FuncDecl),
		funcLits: make(map[*types.Var][]*ast.FuncLit),
		inOp:     make(map[*ast.FuncLit]bool),
		reported: make(map[reportKey]bool),
		handled:  make(map[*ast.FuncDecl]bool),
	}
	c.index()
	c.checkHandlers()
	c.exportHandlerFacts()
	c.checkAttemptTx()
	c.checkEventIDs()
	c.ignores.reportMissingReasons(c)
	return nil, nil
}

// report reports msg on n under rule unless an ignore comment covers n;
// a position is reported once whatever the paths that reach it.
func (c *checker) report(n ast.Node, rule, msg string) {
	if c.sink != nil {
		if !c.ignores.covers(n) {
			c.sink(n, rule, msg)
		}
		return
	}
	k := reportKey{n.Pos(), msg}
	if c.reported[k] {
		return
	}
	c.reported[k] = true
	if c.ignores.covers(n) {
		return
	}
	c.pass.Report(analysis.Diagnostic{Pos: n.Pos(), End: n.End(), Category: rule, Message: msg})
}

// index records the package's function declarations, the function literals
// bound to variables, and the literals that run inside an operation key.
func (c *checker) index() {
	info := c.pass.TypesInfo
	for _, f := range c.pass.Files {
		for _, d := range f.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok && fd.Body != nil {
				if fn, ok := info.Defs[fd.Name].(*types.Func); ok {
					c.decls[fn] = fd
				}
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.AssignStmt:
				if len(n.Lhs) == len(n.Rhs) {
					for i, r := range n.Rhs {
						c.bindFuncLit(n.Lhs[i], r)
					}
				}
			case *ast.ValueSpec:
				if len(n.Names) == len(n.Values) {
					for i, r := range n.Values {
						c.bindFuncLit(n.Names[i], r)
					}
				}
			}
			return true
		})
	}
	for _, f := range c.pass.Files {
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || !isMethod(c.callee(call), operationPath, runnerType, operationScopeSet) {
				return true
			}
			for _, a := range call.Args {
				for _, lit := range c.funcLitsOf(a) {
					c.inOp[lit] = true
				}
			}
			return true
		})
	}
}

func (c *checker) bindFuncLit(lhs ast.Expr, rhs ast.Expr) {
	lit, ok := ast.Unparen(rhs).(*ast.FuncLit)
	if !ok {
		return
	}
	if v := c.varOf(lhs); v != nil {
		c.funcLits[v] = append(c.funcLits[v], lit)
	}
}

// funcLitsOf returns the function literal e is, or those bound to the
// variable e names.
func (c *checker) funcLitsOf(e ast.Expr) []*ast.FuncLit {
	switch e := ast.Unparen(e).(type) {
	case *ast.FuncLit:
		return []*ast.FuncLit{e}
	case *ast.Ident:
		if v, ok := c.pass.TypesInfo.Uses[e].(*types.Var); ok {
			return c.funcLits[v]
		}
	}
	return nil
}

func (c *checker) varOf(e ast.Expr) *types.Var {
	id, ok := ast.Unparen(e).(*ast.Ident)
	if !ok || id.Name == "_" {
		return nil
	}
	v, _ := c.pass.TypesInfo.ObjectOf(id).(*types.Var)
	return v
}

// callee returns the function or method a call calls statically (an
// interface method included), or nil.
func (c *checker) callee(call *ast.CallExpr) *types.Func {
	fn, _ := typeutil.Callee(c.pass.TypesInfo, call).(*types.Func)
	if fn != nil {
		fn = fn.Origin()
	}
	return fn
}

func (c *checker) typeOf(e ast.Expr) types.Type { return c.pass.TypesInfo.TypeOf(e) }

// constString returns the value of e when it is a string constant.
func (c *checker) constString(e ast.Expr) (string, bool) {
	tv, ok := c.pass.TypesInfo.Types[e]
	if !ok || tv.Value == nil || tv.Value.Kind() != constant.String {
		return "", false
	}
	return constant.StringVal(tv.Value), true
}

// sqlArg returns the first string-typed argument of a call when it is a
// constant; ok is false when there is none or it is not constant.
func (c *checker) sqlArg(call *ast.CallExpr) (string, bool) {
	for _, a := range call.Args {
		t := c.typeOf(a)
		if t == nil {
			continue
		}
		if b, ok := t.Underlying().(*types.Basic); ok && b.Info()&types.IsString != 0 {
			return c.constString(a)
		}
	}
	return "", false
}

// named returns the package path and name of t's named type, through one
// pointer.
func named(t types.Type) (pkg, name string) {
	if t == nil {
		return "", ""
	}
	if p, ok := types.Unalias(t).(*types.Pointer); ok {
		t = p.Elem()
	}
	n, ok := types.Unalias(t).(*types.Named)
	if !ok || n.Obj().Pkg() == nil {
		return "", ""
	}
	return n.Obj().Pkg().Path(), n.Obj().Name()
}

// isMethod reports whether fn is one of names, declared on pkg.typ.
func isMethod(fn *types.Func, pkg, typ string, names map[string]bool) bool {
	if fn == nil || !names[fn.Name()] {
		return false
	}
	recv := fn.Type().(*types.Signature).Recv()
	if recv == nil {
		return false
	}
	p, n := named(recv.Type())
	return p == pkg && n == typ
}

// isFunc reports whether fn is a package-level function of pkg in names.
func isFunc(fn *types.Func, pkg string, names map[string]bool) bool {
	return fn != nil && fn.Pkg() != nil && fn.Pkg().Path() == pkg && names[fn.Name()] &&
		fn.Type().(*types.Signature).Recv() == nil
}

func isFuncRef(fn *types.Func, refs []funcRef) bool {
	if fn == nil || fn.Pkg() == nil || fn.Type().(*types.Signature).Recv() != nil {
		return false
	}
	for _, r := range refs {
		if fn.Pkg().Path() == r.pkg && fn.Name() == r.name {
			return true
		}
	}
	return false
}

// isMessage reports whether t is message.Message or *message.Message.
func isMessage(t types.Type) bool {
	p, n := named(t)
	return p == messagePath && n == "Message"
}

func isMessagePtr(t types.Type) bool {
	if t == nil {
		return false
	}
	_, ok := types.Unalias(t).(*types.Pointer)
	return ok && isMessage(t)
}

func isContext(t types.Type) bool {
	if t == nil {
		return false
	}
	if _, ok := types.Unalias(t).(*types.Pointer); ok {
		return false
	}
	p, n := named(t)
	return p == "context" && n == "Context"
}

// funcBody returns the body of a *ast.FuncDecl or *ast.FuncLit.
func funcBody(n ast.Node) *ast.BlockStmt {
	switch n := n.(type) {
	case *ast.FuncDecl:
		return n.Body
	case *ast.FuncLit:
		return n.Body
	}
	return nil
}

func shortName(fn *types.Func) string {
	if recv := fn.Type().(*types.Signature).Recv(); recv != nil {
		_, n := named(recv.Type())
		if n != "" {
			return n + "." + fn.Name()
		}
	}
	if fn.Pkg() != nil {
		return fn.Pkg().Name() + "." + fn.Name()
	}
	return fn.Name()
}
